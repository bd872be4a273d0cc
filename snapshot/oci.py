"""Snapshots as OCI artifacts: ``keepwarm snapshot push NAME REF`` / ``pull REF`` against a container registry.

A snapshot is one OCI image manifest (artifactType :data:`ARTIFACT_TYPE`) whose config is the snapshot manifest
(:data:`MEDIA_CONFIG`) and whose layers are its blobs (:data:`MEDIA_BLOB`, sorted by digest); registry digests are
the store's, so a push skips blobs the registry has (HEAD) and a pull blobs the store has. Rules (docs/snapshots.md,
"OCI registries"):
- the distribution HTTP API (``/v2/``) over httpx, no other client; HTTPS unless ``insecure``; credentials from
  ``--username/--password-stdin`` or the docker config's ``auths``, a 401 answered once (Basic or Bearer); credential
  helpers are not run, and the error says so;
- upload: a session, chunks in order, PUT ``?digest=``; a broken chunk resumes from the session's ``Range``, or
  restarts the blob in a new session when the registry invalidated it (at most RETRIES breaks per blob);
- pull: the OCI manifest and config are size-limited and parsed strictly, every digest ``sha256:<64 hex>``, the
  layers exactly the snapshot manifest's blobs and sizes; blobs are hashed into the store's staging directory and
  nothing lands until every one checked out (a corrupt one is refused naming its digest)."""

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
ARTIFACT_TYPE = "application/vnd.keepwarm.snapshot.v1"
MEDIA_CONFIG = "application/vnd.keepwarm.snapshot.manifest.v1+json"
MEDIA_BLOB = "application/vnd.keepwarm.snapshot.blob.v1"
ANNOTATION_WHAT = "io.keepwarm.blob"
ANNOTATION_NAME = "io.keepwarm.snapshot.name"
DEFAULT_CHUNK = 64 << 20
MAX_OCI_MANIFEST = 4 << 20
RETRIES = 5  # broken connections tolerated per blob

_HOST_RE = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:]+\](:[0-9]{1,5})?")
_REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_OCI_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")


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

    def put_manifest(self, body: bytes) -> None:
        r = self._send("PUT", self.url(f"manifests/{self.ref.tag}"), content=body,
                       headers={"Content-Type": MEDIA_MANIFEST})
        if r.status_code != 201:
            raise self._fail(f"put manifest {self.ref.tag}", r)

    def get_manifest(self) -> bytes:
        r = self._send("GET", self.url(f"manifests/{self.ref.tag}"), headers={"Accept": MEDIA_MANIFEST})
        if r.status_code == 404:
            raise SnapshotError(f"{self.ref} not found in the registry ({_error_text(r)})")
        if r.status_code != 200:
            raise self._fail(f"get manifest {self.ref.tag}", r)
        if len(r.content) > MAX_OCI_MANIFEST:
            raise SnapshotError(f"{self.ref}: a {len(r.content)}-byte manifest is too large")
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
    manifest_digest: str
    blobs: int
    uploaded: int
    uploaded_bytes: int
    total_bytes: int
    seconds: float


def descriptor(media_type: str, digest: str, size: int, annotations: dict[str, str] | None = None) -> dict:
    d: dict[str, Any] = {"mediaType": media_type, "digest": f"sha256:{digest}", "size": size}
    if annotations:
        d["annotations"] = annotations
    return d


def oci_manifest(m: dict[str, Any], config: bytes) -> bytes:
    """The OCI image manifest of a snapshot (deterministic: the same snapshot gives the same bytes)."""
    what: dict[str, str] = {}
    for digest, _, label in mf.blob_refs(m):
        what.setdefault(digest, label)
    layers = [descriptor(MEDIA_BLOB, d, s, {ANNOTATION_WHAT: what[d]}) for d, s in sorted(mf.blobs(m).items())]
    doc = {"schemaVersion": 2, "mediaType": MEDIA_MANIFEST, "artifactType": ARTIFACT_TYPE,
           "config": descriptor(MEDIA_CONFIG, hashlib.sha256(config).hexdigest(), len(config)),
           "layers": layers,
           "annotations": {ANNOTATION_NAME: m["name"],
                           "org.opencontainers.image.created": time.strftime(
                               "%Y-%m-%dT%H:%M:%SZ", time.gmtime(m["created_at"]))}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _pread(fd: int, offset: int, n: int) -> Iterator[bytes]:
    """A chunk's bytes streamed in 1 MiB reads (no chunk-sized buffer; each piece sent while in cache)."""
    end = offset + n
    while offset < end:
        piece = os.pread(fd, min(CHUNK, end - offset), offset)
        if not piece:
            raise SnapshotError(f"blob file ended at byte {offset} (truncated in the store?)")
        offset += len(piece)
        yield piece


def push(store: Store, name: str, reg: Registry) -> PushResult:
    t0 = time.perf_counter()
    with store.lock():
        m, blobs = store.load_complete(name)
        config = mf.dumps(m).encode()
        todo = [(hashlib.sha256(config).hexdigest(), len(config), None), *[(d, s, store.blob_path(d))
                                                                          for d, s in sorted(blobs.items())]]
        uploaded = 0
        for digest, size, path in todo:
            if reg.has_blob(digest, size):
                continue
            reg.say(f"  uploading blob {digest[:12]} ({size} bytes)")
            if path is None:
                reg.upload(digest, size, lambda off, n: [config[off:off + n]])
            else:
                with open(path, "rb", buffering=0) as f:
                    reg.upload(digest, size, functools.partial(_pread, f.fileno()))
            uploaded += 1
        body = oci_manifest(m, config)
        reg.put_manifest(body)
    return PushResult(str(reg.ref), "sha256:" + hashlib.sha256(body).hexdigest(), len(todo), uploaded,
                      reg.uploaded_bytes, sum(s for _, s, _ in todo), time.perf_counter() - t0)


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


def parse_oci_manifest(raw: bytes) -> tuple[tuple[str, int], dict[str, int]]:
    """(config digest and size, layer digest -> size) of a keepwarm snapshot artifact; anything else refused."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotError(f"registry manifest: not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("mediaType", MEDIA_MANIFEST) != MEDIA_MANIFEST \
            or doc.get("schemaVersion") != 2:
        raise SnapshotError("registry manifest: not an OCI image manifest (schemaVersion 2)")
    config = doc.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != MEDIA_CONFIG:
        kind = config.get("mediaType") if isinstance(config, dict) else None
        raise SnapshotError(f"registry manifest: not a keepwarm snapshot (config media type {kind!r})")
    cfg = _digest_of("config", config)
    if cfg[1] > mf.MAX_MANIFEST_BYTES:
        raise SnapshotError(f"registry manifest: a {cfg[1]}-byte snapshot manifest is too large")
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


@dataclass(frozen=True)
class PullResult:
    imported: ImportResult
    downloaded_bytes: int
    seconds: float


def pull(store: Store, reg: Registry, rename: str | None = None, force: bool = False) -> PullResult:
    t0 = time.perf_counter()
    (cfg_digest, cfg_size), layers = parse_oci_manifest(reg.get_manifest())
    config = b"".join(reg.blob_chunks(cfg_digest, cfg_size))
    if hashlib.sha256(config).hexdigest() != cfg_digest:
        raise SnapshotError(f"blob {cfg_digest} (the snapshot manifest) from the registry is corrupt; nothing "
                            "written")
    m = mf.loads(config)
    expected = mf.blobs(m)
    _check_layers(layers, expected)
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
                reg.say(f"  downloading blob {digest[:12]} ({size} bytes)")
                try:
                    store.put_chunks(reg.blob_chunks(digest, size), expect_digest=digest, staging=staging)
                except httpx.TransportError as e:
                    raise SnapshotError(f"download of blob {digest} broke ({e}); nothing written") from None
                except SnapshotError as e:
                    msg = str(e) if "nothing written" in str(e) else f"{e} (from the registry); nothing written"
                    raise SnapshotError(msg) from None
                received[digest] = True
                downloaded += size
            result = commit_staged(store, m, expected, received, staging, rename, force)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return PullResult(result, downloaded, time.perf_counter() - t0)
