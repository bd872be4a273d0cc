"""Snapshots as OCI artifacts: ``keepwarm snapshot push NAME REF`` / ``pull REF`` against a container registry.

A snapshot with the two layers is an OCI image index (artifactType :data:`ARTIFACT_TYPE`): the portable manifest
(config: the snapshot manifest, :data:`MEDIA_CONFIG`; layers: every blob but the platform images') and a manifest
per platform (config: its descriptor, :data:`MEDIA_PLATFORM`; layers: its images; in the index, a ``platform`` and
``io.keepwarm.platform.*`` annotations). One made before the layers is one manifest of all its blobs. Layers are
:data:`MEDIA_BLOB`, sorted, named by the store's digests. Rules (docs/snapshots.md, "OCI registries"):
- the ``/v2/`` API over httpx, no other client; HTTPS unless ``insecure``; credentials from ``--username``/
  ``--password-stdin`` or the docker config's ``auths``, a 401 answered once (Basic or Bearer); no credential helpers;
- push skips blobs the registry has (HEAD); upload: a session, chunks in order, PUT ``?digest=``; a broken chunk
  resumes from the session's ``Range``, or restarts in a new session (RETRIES breaks per blob); an index's manifests
  are PUT by digest before the index is PUT by tag; the same snapshot gives the same bytes;
- pull: indexes, manifests and configs are size-limited and parsed strictly (digests ``sha256:<64 hex>``, layers
  exactly the snapshot manifest's); of an index the portable layer and only this machine's platform; blobs the store
  has are skipped, the rest hashed into staging, and nothing lands until every one checked out (a bad one named)."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx

from keepwarm.snapshot import manifest as mf
from keepwarm.snapshot.archive import ImportResult, commit_staged, target_name
from keepwarm.snapshot.manifest import SnapshotError
from keepwarm.snapshot.store import CHUNK, Store

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
ARTIFACT_TYPE = "application/vnd.keepwarm.snapshot.v1"
MEDIA_CONFIG = "application/vnd.keepwarm.snapshot.manifest.v1+json"
MEDIA_BLOB = "application/vnd.keepwarm.snapshot.blob.v1"
MEDIA_PLATFORM = "application/vnd.keepwarm.snapshot.platform.v1+json"  # a platform manifest's config: its descriptor
ANNOTATION_WHAT = "io.keepwarm.blob"
ANNOTATION_NAME = "io.keepwarm.snapshot.name"
ANNOTATION_PLATFORM = "io.keepwarm.platform"  # "portable" on the portable manifest; .key, .name, ... on a platform's
DEFAULT_CHUNK = 64 << 20
MAX_OCI_MANIFEST = 4 << 20
MAX_PLATFORM_CONFIG = 64 << 10
RETRIES = 5  # broken connections tolerated per blob

_HOST_RE = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:]+\](:[0-9]{1,5})?")
_REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_OCI_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}  # OCI names CPUs as Go does

# this machine's platform key for a pull of an index: the key, None (the portable layer only), or a function asked
# only when the tag is an index (finding the key may ask the daemon or import torch)
PlatformKey = str | Callable[[], str | None] | None


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port]
    repository: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> Reference:
        """``REGISTRY/REPO:TAG``: the registry part is required (no implicit Docker Hub)."""
        host, _, rest = text.partition("/")
        repo, sep, tag = rest.rpartition(":")
        if not sep or "/" in tag:
            raise SnapshotError(f"invalid reference {text!r}: use REGISTRY/REPOSITORY:TAG (a tag is required)")
        if not _HOST_RE.fullmatch(host):
            raise SnapshotError(f"invalid reference {text!r}: {host!r} is not a registry host[:port]")
        if not _REPO_RE.fullmatch(repo):
            raise SnapshotError(f"invalid reference {text!r}: repository {repo!r} must be lowercase path "
                                "components of letters, digits and . _ -")
        if not _TAG_RE.fullmatch(tag):
            raise SnapshotError(f"invalid reference {text!r}: tag {tag!r} must match [A-Za-z0-9_][A-Za-z0-9._-]*")
        return cls(host, repo, tag)

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}:{self.tag}"


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)


def docker_config_credentials(registry: str, path: Path | None = None) -> tuple[Credentials | None, str]:
    """(credentials for ``registry`` from the docker config, a note when that config defers to a helper)."""
    if path is None:
        path = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        raise SnapshotError(f"cannot read the docker config {path}: {e}") from None
    auths = cfg.get("auths") if isinstance(cfg, dict) else None
    for key, entry in (auths or {}).items():
        host = re.sub(r"^https?://", "", key).split("/")[0]
        if host == registry and isinstance(entry, dict) and isinstance(entry.get("auth"), str):
            try:
                user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise SnapshotError(f"{path}: auths[{key!r}].auth is not base64 of user:password") from None
            if not sep:
                raise SnapshotError(f"{path}: auths[{key!r}].auth is not base64 of user:password")
            return Credentials(user, password), ""
    helper = (cfg.get("credHelpers") or {}).get(registry) or cfg.get("credsStore")
    return None, (f" ({path} defers to the credential helper {helper!r}, which keepwarm does not run)"
                  if helper else "")


def _error_text(r: httpx.Response) -> str:
    try:
        errors = r.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors) or r.text[:200]
    except (ValueError, AttributeError):
        return r.text[:200].strip() or r.reason_phrase


class Registry:
    """One repository on one registry: the calls push and pull need, with auth and resumable chunked uploads."""

    def __init__(self, ref: Reference, *, insecure: bool = False, credentials: Credentials | None = None,
                 chunk_size: int = DEFAULT_CHUNK, say: Callable[[str], None] = lambda _: None,
                 docker_config: Path | None = None) -> None:
        if chunk_size < 1:
            raise SnapshotError("--chunk-size must be at least 1 byte")
        self.ref = ref
        self.insecure = insecure
        self.base = f"{'http' if insecure else 'https'}://{ref.registry}"
        self.chunk_size = chunk_size
        self.say = say
        self.helper_note = ""
        if credentials is None:
            credentials, self.helper_note = docker_config_credentials(ref.registry, docker_config)
        self.credentials = credentials
        self.authorization: str | None = None
        self.http = httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0))
        self.uploaded_bytes = 0

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self, path: str) -> str:
        return f"{self.base}/v2/{self.ref.repository}/{path}"

    # -- requests and auth -----------------------------------------------------------------------------------------
    def _send(self, method: str, url: str, *, stream: bool = False, **kw: Any) -> httpx.Response:
        """One request; a 401 is answered once (Basic or Bearer) and the request sent again. A callable
        ``content`` makes the (streamed) body anew for each attempt."""
        for attempt in range(2):
            headers = dict(kw.get("headers") or {})
            if self.authorization:
                headers["Authorization"] = self.authorization
            content = kw.get("content")
            body = {"content": content()} if callable(content) else {}
            req = self.http.build_request(method, url, **{**kw, **body, "headers": headers})
            try:
                r = self.http.send(req, stream=stream, follow_redirects=method in ("GET", "HEAD"))
            except httpx.ConnectError as e:
                raise self._unreachable(e) from None
            if r.status_code != 401 or attempt:
                return r
            r.close()
            self._authenticate(r)
        raise AssertionError("unreachable")

    def _unreachable(self, e: Exception) -> SnapshotError:
        if self.insecure:
            return SnapshotError(f"cannot reach the registry {self.base} ({e})")
        return SnapshotError(f"cannot reach https://{self.ref.registry} ({e}); a registry that speaks plain HTTP "
                             "needs --insecure")

    def _authenticate(self, r: httpx.Response) -> None:
        challenge = r.headers.get("www-authenticate", "")
        scheme = challenge.split(" ", 1)[0].lower()
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        creds = self.credentials
        if scheme == "basic":
            if creds is None:
                raise SnapshotError(f"the registry {self.ref.registry} wants credentials: add them to the docker "
                                    f"config or pass --username/--password-stdin{self.helper_note}")
            self.authorization = "Basic " + base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()
            return
        if scheme != "bearer" or "realm" not in params:
            raise SnapshotError(f"the registry {self.ref.registry} answered 401 with an unsupported challenge "
                                f"{challenge[:100]!r}")
        realm = params["realm"]
        if not realm.startswith("https://") and not (self.insecure and realm.startswith("http://")):
            raise SnapshotError(f"the registry's token service {realm!r} is not HTTPS; refusing to use it without "
                                "--insecure")
        query = {k: params[k] for k in ("service", "scope") if k in params}
        query.setdefault("scope", f"repository:{self.ref.repository}:pull,push")
        try:
            t = self.http.get(realm, params=query, auth=(creds.username, creds.password) if creds else None)
        except httpx.HTTPError as e:
            raise SnapshotError(f"cannot reach the registry's token service {realm} ({e})") from None
        if t.status_code != 200:
            hint = "" if creds else f" (no credentials given{self.helper_note})"
            raise SnapshotError(f"the token service {realm} refused: {t.status_code} {_error_text(t)}{hint}")
        try:
            body = t.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not isinstance(token, str) or not token:
            raise SnapshotError(f"the token service {realm} answered without a token")
        self.authorization = f"Bearer {token}"

    def _fail(self, what: str, r: httpx.Response) -> SnapshotError:
        return SnapshotError(f"registry {self.ref.registry}: {what}: HTTP {r.status_code} {_error_text(r)}")

    # -- blobs -----------------------------------------------------------------------------------------------------
    def has_blob(self, digest: str, size: int) -> bool:
        r = self._send("HEAD", self.url(f"blobs/sha256:{digest}"))
        if r.status_code == 404:
            return False
        if r.status_code != 200:
            raise self._fail(f"HEAD blob {digest}", r)
        length = r.headers.get("content-length")
        return length is None or int(length) == size

    def _start_upload(self) -> str:
        r = self._send("POST", self.url("blobs/uploads/"))
        if r.status_code != 202 or "location" not in r.headers:
            raise self._fail("start an upload", r)
        return urljoin(str(r.request.url), r.headers["location"])

    def _resume(self, location: str, digest: str, offset: int) -> tuple[str, int]:
        """Where the interrupted session stands (its Range); a new session from 0 when the registry dropped it."""
        try:
            r = self._send("GET", location)
        except httpx.TransportError:
            r = None
        m = re.fullmatch(r"0-([0-9]+)", r.headers.get("range", "")) if r is not None else None
        if r is not None and r.status_code == 204 and m:
            end = int(m.group(1))
            # "0-0" means nothing or one byte (distribution); a session we never got past 0 holds nothing.
            at = end + 1 if end or offset > 1 else 0
            self.say(f"  blob {digest[:12]}: the connection broke; resuming at byte {at} (session range 0-{end})")
            return urljoin(str(r.request.url), r.headers.get("location", location)), at
        self.say(f"  blob {digest[:12]}: the connection broke and the registry dropped the upload session; "
                 "uploading this blob again from byte 0")
        return self._start_upload(), 0

    def upload(self, digest: str, size: int, read_at: Callable[[int, int], Iterable[bytes]]) -> None:
        """Chunked, resumable upload of one blob; the registry checks the digest at the end."""
        location = self._start_upload()
        offset, breaks = 0, 0
        while True:
            try:
                while offset < size:
                    n = min(self.chunk_size, size - offset)
                    r = self._send("PATCH", location, content=functools.partial(read_at, offset, n), headers={
                        "Content-Type": "application/octet-stream", "Content-Range": f"{offset}-{offset + n - 1}",
                        "Content-Length": str(n)})
                    if r.status_code != 202:
                        raise self._fail(f"upload blob {digest} (bytes {offset}-{offset + n - 1})", r)
                    location = urljoin(str(r.request.url), r.headers.get("location", location))
                    offset += n
                    self.uploaded_bytes += n
                # the session URL's own query (distribution's _state) stays: httpx's params= would replace it
                r = self._send("PUT", str(httpx.URL(location).copy_add_param("digest", f"sha256:{digest}")))
                if r.status_code != 201:
                    raise self._fail(f"finish blob {digest}", r)
                return
            except httpx.TransportError as e:
                breaks += 1
                if breaks > RETRIES:
                    raise SnapshotError(f"upload of blob {digest} broke {breaks} times (last: {e}); run the "
                                        "push again to resume") from None
                if offset >= size and self.has_blob(digest, size):
                    return  # the PUT landed, its answer was lost
                location, offset = self._resume(location, digest, offset)

    def put_manifest(self, body: bytes, reference: str | None = None, media_type: str = MEDIA_MANIFEST) -> None:
        """PUT a manifest (or index) under ``reference``: the tag, or ``sha256:<hex>`` (the registry checks it)."""
        ref = reference or self.ref.tag
        r = self._send("PUT", self.url(f"manifests/{ref}"), content=body, headers={"Content-Type": media_type})
        if r.status_code != 201:
            raise self._fail(f"put manifest {ref}", r)

    def get_manifest(self, accept: tuple[str, ...] = (MEDIA_MANIFEST,)) -> tuple[bytes, str]:
        """The tag's manifest or index (size-limited) and the media type the registry says it is."""
        r = self._send("GET", self.url(f"manifests/{self.ref.tag}"), headers={"Accept": ", ".join(accept)})
        if r.status_code == 404:
            raise SnapshotError(f"{self.ref} not found in the registry ({_error_text(r)})")
        if r.status_code != 200:
            raise self._fail(f"get manifest {self.ref.tag}", r)
        if len(r.content) > MAX_OCI_MANIFEST:
            raise SnapshotError(f"{self.ref}: a {len(r.content)}-byte manifest is too large")
        return r.content, r.headers.get("content-type", "").split(";")[0].strip()

    def get_manifest_by_digest(self, digest: str, size: int) -> bytes:
        """A manifest an index names, refused unless its bytes are that digest and size."""
        if size > MAX_OCI_MANIFEST:
            raise SnapshotError(f"registry index: a {size}-byte manifest is too large")
        r = self._send("GET", self.url(f"manifests/sha256:{digest}"), headers={"Accept": MEDIA_MANIFEST})
        if r.status_code != 200:
            raise self._fail(f"get manifest sha256:{digest}", r)
        if len(r.content) != size or hashlib.sha256(r.content).hexdigest() != digest:
            raise SnapshotError(f"manifest sha256:{digest} from the registry does not match its digest; nothing "
                                "written")
        return r.content

    def blob_chunks(self, digest: str, size: int) -> Iterator[memoryview]:
        """The blob's bytes as they arrive; more than ``size`` bytes is refused."""
        r = self._send("GET", self.url(f"blobs/sha256:{digest}"), stream=True)
        try:
            if r.status_code != 200:
                r.read()
                raise self._fail(f"get blob {digest}", r)
            got = 0
            for chunk in r.iter_bytes(CHUNK):
                got += len(chunk)
                if got > size:
                    raise SnapshotError(f"blob {digest} from the registry is larger than its {size} bytes; "
                                        "nothing written")
                yield memoryview(chunk)
            if got != size:
                raise SnapshotError(f"blob {digest} from the registry has {got} bytes, not {size}; nothing written")
        finally:
            r.close()


# -- push ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PushResult:
    reference: str
    manifest_digest: str  # the tag's: the index of a layered snapshot, else its one manifest
    blobs: int
    uploaded: int
    uploaded_bytes: int
    total_bytes: int
    seconds: float
    platforms: tuple[str, ...] = ()  # the platform images' names in the index (none: a plain manifest)


def descriptor(media_type: str, digest: str, size: int, annotations: dict[str, str] | None = None) -> dict:
    d: dict[str, Any] = {"mediaType": media_type, "digest": f"sha256:{digest}", "size": size}
    if annotations:
        d["annotations"] = annotations
    return d


def _json(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _blob_desc(data: bytes, media_type: str) -> dict:
    return descriptor(media_type, hashlib.sha256(data).hexdigest(), len(data))


def _layers(refs: Iterable[tuple[str, int, str]]) -> list[dict]:
    """Layer descriptors of blobs (digest, size, what), one per digest, sorted by digest, each annotated with what it
    is first named as."""
    what: dict[str, tuple[int, str]] = {}
    for digest, size, label in refs:
        what.setdefault(digest, (size, label))
    return [descriptor(MEDIA_BLOB, d, s, {ANNOTATION_WHAT: label}) for d, (s, label) in sorted(what.items())]


def _annotations(m: dict[str, Any], **extra: str) -> dict[str, str]:
    return {ANNOTATION_NAME: m["name"],
            "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m["created_at"])),
            **extra}


def _manifest_doc(config: dict, layers: list[dict], annotations: dict[str, str]) -> bytes:
    return _json({"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "artifactType": ARTIFACT_TYPE, "config": config,
                  "layers": layers, "annotations": annotations})


def oci_manifest(m: dict[str, Any], config: bytes) -> bytes:
    """The one OCI image manifest of a snapshot made before the two layers (deterministic: the same snapshot gives the
    same bytes)."""
    return _manifest_doc(_blob_desc(config, MEDIA_CONFIG), _layers(mf.blob_refs(m)), _annotations(m))


def layered(m: dict[str, Any]) -> bool:
    """True for a snapshot with the two layers (pushed as an index)."""
    return any(mf.layered(a) for mod in m["models"] for a in mf.images(mod))


def platforms(m: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """key -> descriptor of every platform image the snapshot holds, in the order they were added."""
    out: dict[str, dict[str, Any]] = {}
    for mod in m["models"]:
        for a in mf.images(mod):
            for p in (a["platforms"] if mf.layered(a) else []):
                out.setdefault(p["platform"]["key"], p["platform"])
    return out


def platform_refs(m: dict[str, Any], key: str) -> list[tuple[str, int, str]]:
    """The blobs of one platform's images (image and image manifest of every arena and shard): (digest, size, what)."""
    out = []
    for mod in m["models"]:
        for a in mf.images(mod):
            shard = f" (stage {a.get('pp_stage', 0)}, rank {a['tp_rank']})" if "tp_rank" in a else ""
            for p in (a["platforms"] if mf.layered(a) else []):
                if p["platform"]["key"] == key:
                    what = f"model {mod['name']}: {p['platform']['name']} arena"
                    out += [(p["image"]["digest"], p["image"]["size"], f"{what} image{shard}"),
                            (p["image_manifest"]["digest"], p["image_manifest"]["size"], f"{what} manifest{shard}")]
    return out


def platform_annotations(desc: dict[str, Any]) -> dict[str, str]:
    """``io.keepwarm.platform.*``: what names the platform (tools show them: skopeo inspect --raw, oras)."""
    fields = ["key", "name", "device", *(("isa", "pack_key", "int4_layout") if desc.get("device") == "cpu" else
                                         ("capability",))]
    return {f"{ANNOTATION_PLATFORM}.{f}": ",".join(map(str, desc[f])) if isinstance(desc[f], list) else str(desc[f])
            for f in fields if f in desc}


def oci_platform(desc: dict[str, Any]) -> dict[str, str] | None:
    """The OCI ``platform`` of a CPU image (its architecture in Go's names); a CUDA descriptor names no host CPU."""
    arch = desc.get("arch") if desc.get("device") == "cpu" else None
    if not isinstance(arch, str) or not arch:
        return None
    return {"architecture": _GOARCH.get(arch, arch), "os": "linux"}


@dataclass(frozen=True)
class OciIndex:
    index: bytes
    manifests: list[bytes]  # PUT by digest before the index
    configs: list[bytes]  # the manifests' config blobs: the snapshot manifest, then one per platform
    platform_names: tuple[str, ...]


def oci_index(m: dict[str, Any], config: bytes) -> OciIndex:
    """The OCI image index of a layered snapshot: the portable manifest (config: the whole snapshot manifest; layers:
    every blob but the platform images'), then one manifest per platform (config: its descriptor; layers: its
    images). Deterministic: the same snapshot gives the same bytes."""
    portable_refs = mf.blob_refs(mf.without_platforms(m, set()))
    bodies = [_manifest_doc(_blob_desc(config, MEDIA_CONFIG), _layers(portable_refs),
                            _annotations(m, **{ANNOTATION_PLATFORM: "portable"}))]
    entries = [descriptor(MEDIA_MANIFEST, hashlib.sha256(bodies[0]).hexdigest(), len(bodies[0]),
                          {ANNOTATION_PLATFORM: "portable"})]
    configs = [config]
    for key, desc in platforms(m).items():
        pconfig = _json(desc)
        notes = platform_annotations(desc)
        body = _manifest_doc(_blob_desc(pconfig, MEDIA_PLATFORM), _layers(platform_refs(m, key)),
                             _annotations(m, **notes))
        entry = descriptor(MEDIA_MANIFEST, hashlib.sha256(body).hexdigest(), len(body), notes)
        if (plat := oci_platform(desc)) is not None:
            entry["platform"] = plat
        bodies.append(body)
        entries.append(entry)
        configs.append(pconfig)
    index = _json({"schemaVersion": 2, "mediaType": MEDIA_INDEX, "artifactType": ARTIFACT_TYPE,
                   "manifests": entries, "annotations": _annotations(m)})
    return OciIndex(index, bodies, configs, tuple(d["name"] for d in platforms(m).values()))


def _pread(fd: int, offset: int, n: int) -> Iterator[bytes]:
    """A chunk's bytes streamed in 1 MiB reads (no chunk-sized buffer; each piece sent while in cache)."""
    end = offset + n
    while offset < end:
        piece = os.pread(fd, min(CHUNK, end - offset), offset)
        if not piece:
            raise SnapshotError(f"blob file ended at byte {offset} (truncated in the store?)")
        offset += len(piece)
        yield piece


def _slice(data: bytes, offset: int, n: int) -> list[bytes]:
    return [data[offset:offset + n]]


def _upload_all(store: Store, reg: Registry, configs: list[bytes], blobs: dict[str, int]) -> tuple[int, int, int]:
    """Upload the config blobs and the store's blobs the registry lacks: (blobs, uploaded, total bytes)."""
    todo: list[tuple[str, int, bytes | Path]] = [(hashlib.sha256(c).hexdigest(), len(c), c) for c in configs]
    todo += [(d, s, store.blob_path(d)) for d, s in sorted(blobs.items())]
    todo = list({d: (d, s, src) for d, s, src in todo}.values())
    uploaded = 0
    for digest, size, src in todo:
        if reg.has_blob(digest, size):
            continue
        reg.say(f"  uploading blob {digest[:12]} ({size} bytes)")
        if isinstance(src, bytes):
            reg.upload(digest, size, functools.partial(_slice, src))
        else:
            with open(src, "rb", buffering=0) as f:
                reg.upload(digest, size, functools.partial(_pread, f.fileno()))
        uploaded += 1
    return len(todo), uploaded, sum(s for _, s, _ in todo)


def push(store: Store, name: str, reg: Registry) -> PushResult:
    """Push a snapshot under the tag: an index (its manifests PUT by digest first) when it has the two layers, else
    one manifest as before them."""
    t0 = time.perf_counter()
    with store.lock():
        m, blobs = store.load_complete(name)
        config = mf.dumps(m).encode()
        if layered(m):
            idx = oci_index(m, config)
            n, uploaded, total = _upload_all(store, reg, idx.configs, blobs)
            for body in idx.manifests:
                reg.put_manifest(body, f"sha256:{hashlib.sha256(body).hexdigest()}")
            body, names = idx.index, idx.platform_names
            reg.put_manifest(body, media_type=MEDIA_INDEX)
        else:
            n, uploaded, total = _upload_all(store, reg, [config], blobs)
            body, names = oci_manifest(m, config), ()
            reg.put_manifest(body)
    return PushResult(str(reg.ref), "sha256:" + hashlib.sha256(body).hexdigest(), n, uploaded, reg.uploaded_bytes,
                      total, time.perf_counter() - t0, names)


# -- pull ----------------------------------------------------------------------------------------------------------
def _digest_of(where: str, desc: Any) -> tuple[str, int]:
    """A descriptor's hex digest and size, refused unless ``sha256:<64 hex>`` and a non-negative integer."""
    if not isinstance(desc, dict):
        raise SnapshotError(f"registry manifest: {where} is not a descriptor")
    m = _OCI_DIGEST_RE.fullmatch(str(desc.get("digest")))
    if not m:
        raise SnapshotError(f"registry manifest: {where} has digest {str(desc.get('digest'))[:80]!r}, not "
                            "sha256:<64 hex>; refusing it")
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise SnapshotError(f"registry manifest: {where} has no valid size")
    return m.group(1), size


def _doc(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotError(f"registry {what}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise SnapshotError(f"registry {what}: not a JSON object")
    return doc


def parse_oci_manifest(raw: bytes, config_type: str = MEDIA_CONFIG,
                       max_config: int = mf.MAX_MANIFEST_BYTES) -> tuple[tuple[str, int], dict[str, int]]:
    """(config digest and size, layer digest -> size) of a keepwarm snapshot artifact (``config_type``: the snapshot
    manifest, or a platform descriptor); anything else refused."""
    doc = _doc(raw, "manifest")
    if doc.get("mediaType", MEDIA_MANIFEST) != MEDIA_MANIFEST or doc.get("schemaVersion") != 2:
        raise SnapshotError("registry manifest: not an OCI image manifest (schemaVersion 2)")
    config = doc.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != config_type:
        kind = config.get("mediaType") if isinstance(config, dict) else None
        raise SnapshotError(f"registry manifest: not a keepwarm snapshot (config media type {kind!r})")
    cfg = _digest_of("config", config)
    if cfg[1] > max_config:
        raise SnapshotError(f"registry manifest: a {cfg[1]}-byte config ({config_type}) is too large")
    layers: dict[str, int] = {}
    if not isinstance(doc.get("layers"), list):
        raise SnapshotError("registry manifest: layers must be a list")
    for i, layer in enumerate(doc["layers"]):
        digest, size = _digest_of(f"layers[{i}]", layer)
        if layer.get("mediaType") != MEDIA_BLOB:
            raise SnapshotError(f"registry manifest: layers[{i}] has media type {layer.get('mediaType')!r}, not "
                                f"{MEDIA_BLOB}")
        if layers.setdefault(digest, size) != size:
            raise SnapshotError(f"registry manifest: blob {digest} is named with two sizes")
    return cfg, layers


@dataclass(frozen=True)
class IndexEntries:
    portable: tuple[str, int]  # the portable manifest's digest and size
    platforms: dict[str, tuple[str, int]]  # platform key -> its manifest's digest and size


def parse_oci_index(raw: bytes) -> IndexEntries:
    """The manifests of a keepwarm snapshot index: exactly one portable, one per platform key; anything else refused."""
    doc = _doc(raw, "index")
    if doc.get("mediaType") != MEDIA_INDEX or doc.get("schemaVersion") != 2:
        raise SnapshotError("registry index: not an OCI image index (schemaVersion 2)")
    if doc.get("artifactType") != ARTIFACT_TYPE:
        raise SnapshotError(f"registry index: not a keepwarm snapshot (artifactType {doc.get('artifactType')!r})")
    if not isinstance(doc.get("manifests"), list):
        raise SnapshotError("registry index: manifests must be a list")
    portable: list[tuple[str, int]] = []
    keyed: dict[str, tuple[str, int]] = {}
    for i, entry in enumerate(doc["manifests"]):
        ref = _digest_of(f"manifests[{i}]", entry)
        notes = entry.get("annotations")
        if entry.get("mediaType") != MEDIA_MANIFEST or not isinstance(notes, dict):
            raise SnapshotError(f"registry index: manifests[{i}] is not a keepwarm snapshot manifest")
        key = notes.get(f"{ANNOTATION_PLATFORM}.key")
        if notes.get(ANNOTATION_PLATFORM) == "portable" and key is None:
            portable.append(ref)
        elif isinstance(key, str) and mf.PLATFORM_KEY_RE.fullmatch(key) and key not in keyed:
            keyed[key] = ref
        else:
            raise SnapshotError(f"registry index: manifests[{i}] is neither the portable layer nor a platform image "
                                "with a new key")
    if len(portable) != 1:
        raise SnapshotError(f"registry index: {len(portable)} portable manifests, not one")
    return IndexEntries(portable[0], keyed)


def _check_layers(layers: dict[str, int], expected: dict[str, int]) -> None:
    for digest, size in expected.items():
        if digest not in layers:
            raise SnapshotError(f"blob {digest} of the snapshot is not a layer of the registry manifest")
        if layers[digest] != size:
            raise SnapshotError(f"blob {digest} has {layers[digest]} bytes in the registry manifest, the snapshot "
                                f"says {size}")
    extra = sorted(set(layers) - set(expected))
    if extra:
        raise SnapshotError(f"layer {extra[0]} of the registry manifest is not named by the snapshot")


def _small_blob(reg: Registry, digest: str, size: int, what: str) -> bytes:
    data = b"".join(reg.blob_chunks(digest, size))
    if hashlib.sha256(data).hexdigest() != digest:
        raise SnapshotError(f"blob {digest} ({what}) from the registry is corrupt; nothing written")
    return data


@dataclass(frozen=True)
class PullPlan:
    manifest: dict[str, Any]  # what the store records: the platform images it gets, no other
    platform: dict[str, Any] | None  # the platform image fetched (None: the portable layer only, or a plain manifest)
    index: bool  # the tag is an index (else a plain manifest, pushed before the two layers)
    key: str | None = None  # this machine's platform key, asked for where the tag is an index


def _plan_plain(reg: Registry, raw: bytes) -> PullPlan:
    (cfg_digest, cfg_size), layers = parse_oci_manifest(raw)
    m = mf.loads(_small_blob(reg, cfg_digest, cfg_size, "the snapshot manifest"))
    _check_layers(layers, mf.blobs(m))
    return PullPlan(m, None, False)


def _plan_index(reg: Registry, raw: bytes, platform_key: PlatformKey) -> PullPlan:
    """The portable manifest and its config (the whole snapshot manifest), then this machine's platform manifest,
    each checked against the snapshot manifest."""
    entries = parse_oci_index(raw)
    (cfg_digest, cfg_size), layers = parse_oci_manifest(reg.get_manifest_by_digest(*entries.portable))
    m = mf.loads(_small_blob(reg, cfg_digest, cfg_size, "the snapshot manifest"))
    known = platforms(m)
    if set(known) != set(entries.platforms):
        raise SnapshotError(f"registry index: its platform manifests ({', '.join(sorted(entries.platforms))}) are "
                            f"not the snapshot's platforms ({', '.join(sorted(known))})")
    _check_layers(layers, mf.blobs(mf.without_platforms(m, set())))
    key = platform_key() if callable(platform_key) else platform_key
    if key not in entries.platforms:
        return PullPlan(mf.validate(mf.without_platforms(m, set())), None, True, key)
    (pcfg_digest, pcfg_size), players = parse_oci_manifest(reg.get_manifest_by_digest(*entries.platforms[key]),
                                                            MEDIA_PLATFORM, MAX_PLATFORM_CONFIG)
    try:
        desc = json.loads(_small_blob(reg, pcfg_digest, pcfg_size, f"the descriptor of platform {key}"))
    except ValueError:
        desc = None
    if desc != known[key]:
        raise SnapshotError(f"registry index: the manifest of platform {key} describes another platform than the "
                            "snapshot's")
    _check_layers(players, {d: s for d, s, _ in platform_refs(m, key)})
    return PullPlan(mf.validate(mf.without_platforms(m, {key})), known[key], True, key)


@dataclass(frozen=True)
class PullResult:
    imported: ImportResult
    downloaded_bytes: int
    seconds: float
    downloaded: int = 0  # blobs downloaded
    skipped: int = 0  # blobs the store had
    platform: dict[str, Any] | None = None  # the platform image fetched, None: the portable layer only (or plain)
    index: bool = False  # the tag was an index (else a plain manifest, pushed before the two layers)
    platform_key: str | None = None  # this machine's platform key, where the tag was an index


def pull(store: Store, reg: Registry, rename: str | None = None, force: bool = False,
         platform_key: PlatformKey = None) -> PullResult:
    """Pull the tag: an index (the portable layer plus the platform image whose key is ``platform_key``, a function
    asked only then, or none) or a plain manifest (everything). Blobs the store has are skipped."""
    t0 = time.perf_counter()
    raw, media_type = reg.get_manifest(accept=(MEDIA_INDEX, MEDIA_MANIFEST))
    is_index = _doc(raw, "manifest").get("mediaType", media_type) == MEDIA_INDEX
    plan = _plan_index(reg, raw, platform_key) if is_index else _plan_plain(reg, raw)
    m = plan.manifest
    expected = mf.blobs(m)
    target_name(store, m, rename, force)  # refuse a name clash before downloading anything
    downloaded = 0
    store.ensure()
    with store.lock():
        staging = store.staging_dir("pull")
        try:
            received: dict[str, bool] = {}
            for digest, size in sorted(expected.items()):
                if store.has_blob(digest, size):
                    continue
                _download(store, reg, digest, size, staging)
                received[digest] = True
                downloaded += size
            result = commit_staged(store, m, expected, received, staging, rename, force)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return PullResult(result, downloaded, time.perf_counter() - t0, len(received), len(expected) - len(received),
                      plan.platform, plan.index, plan.key)


def _download(store: Store, reg: Registry, digest: str, size: int, staging: Path) -> None:
    """One blob into ``staging``, hashed as it arrives; a corrupt or broken one refused with nothing written."""
    reg.say(f"  downloading blob {digest[:12]} ({size} bytes)")
    try:
        store.put_chunks(reg.blob_chunks(digest, size), expect_digest=digest, staging=staging)
    except httpx.TransportError as e:
        raise SnapshotError(f"download of blob {digest} broke ({e}); nothing written") from None
    except SnapshotError as e:
        msg = str(e) if "nothing written" in str(e) else f"{e} (from the registry); nothing written"
        raise SnapshotError(msg) from None


def this_platform_key(runtime_dir: Path | None = None) -> str:
    """This machine's platform key: the daemon's (``status``) where one answers at the runtime dir, else the CPU's."""
    from keepwarm.daemon.client import DaemonClient  # deferred: zmq and psutil, for a pull of an index alone

    with DaemonClient(runtime_dir) as client:
        status = client.ping(timeout=2.0)
    platform = (status or {}).get("platform")
    if isinstance(platform, dict) and isinstance(platform.get("key"), str):
        return platform["key"]
    # deferred, these two: torch (~1.2 s), paid only by a pull of an index with no daemon to ask
    import torch

    from keepwarm.weights.portable import platform_descriptor  # deferred (above): it imports torch

    return str(platform_descriptor(torch.device("cpu"))["key"])
