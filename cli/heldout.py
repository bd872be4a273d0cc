"""A fixed held-out English text for perplexity measurements (written for keepwarm; no model has seen it)."""

HELDOUT_TEXT = """\
The lighthouse at the end of the northern pier had not been lit for eleven years when Mara Velasquez bought it at an
auction that nobody else attended. The town council had expected the building to be torn down, and the clerk who
handed her the keys warned her that the stairs were rotten, the lens was cracked, and the roof leaked in three
places whenever the wind came from the east. She thanked him, signed the papers, and walked out along the pier in
the grey afternoon with a bag of tools over one shoulder and a notebook in her coat pocket.

Inside, the air smelled of salt and old paint. Pigeons had nested on the landing below the lamp room, and the iron
railing of the spiral staircase was cold and flaking under her hand. She counted the steps as she climbed: one
hundred and twelve. At the top, the great glass lens sat in its brass frame like a sleeping animal, its prisms
dulled by years of dust. A thin crack ran across one panel, exactly as the clerk had said, but the rest of the
glass was whole.

For the first month she did nothing but clean and measure. She scraped the walls, replaced the broken window
panes, and wrote down the dimensions of every part of the lamp mechanism. The clockwork that had once turned the
lens was seized with rust, but the gears themselves were sound. Each evening she carried a small stove up to the
lamp room, boiled water for tea, and read through the keeper's logbooks she had found in a locked cabinet. The
entries were brief and practical: the weather, the hours the lamp was lit, the ships that passed, the days when
fog rolled in so thickly that the keeper rang the bell every thirty seconds until dawn.

One entry stopped her. It was dated the winter before the light went dark, and the handwriting was more careful
than usual. The keeper described a fishing boat that had lost its engine in a storm and drifted toward the rocks
below the point. He had kept the lamp turning all night by hand after the clockwork failed, pushing the heavy frame
around its track every few seconds for nine hours, until the boat's crew managed to row clear. In the morning, he
wrote, his arms would not lift a cup. The next page said only that the council had voted to replace the
lighthouse with an automatic buoy, and that he would leave at the end of the month.

Mara read the entry twice and then closed the book. The next day she took the clockwork apart on the floor of the
lamp room, soaked each gear in oil, and cleaned the teeth with a brass brush until they shone. She ordered a new
mainspring from a workshop in the city, and while she waited for it she repaired the roof, laying new slate over the
worst of the leaks. The spring arrived in a wooden crate packed with straw. Fitting it took most of an afternoon
and two skinned knuckles, but when she wound the mechanism and released the brake, the lens began to turn, slowly
at first and then with a steady, patient rhythm.

She did not have permission to light it. The harbor authority had long since removed the lighthouse from its
charts, and a working lamp might confuse the pilots who now relied on the buoy. So she kept the lens turning in the
dark, an empty beacon, and spent her evenings writing letters to the authority explaining why the light should be
restored. She described the rocks below the point, the fog that gathered there in winter, and the boats that still
came too close when their instruments failed. She enclosed copies of the keeper's logbook.

The reply came in spring. An inspector would visit to assess the building. He arrived on a bright morning, climbed
the one hundred and twelve steps without complaint, and stood for a long time in front of the lens, watching it
turn. Then he asked to see the logbook. When he had finished reading, he looked out at the water and said that his
father had been a fisherman on this coast. That autumn, for the first time in twelve years, the light at the end of
the northern pier swept across the harbor again, and on foggy nights the bell rang every thirty seconds until dawn.
"""
