"""A site's corpus through the scrubber: every core, cached by content, in input order, reported.

`CorpusScrubber` is what the rest of the framework calls:
- the text data path: `scrub = CorpusScrubber(cfg, cache_dir=workdir / "pii")`, then
  `scrub(path, text) -> text | None` per document (or `scrub.map(docs)` for all cores), with
  `scrub.fingerprint` in the key of anything cached downstream (token caches);
- `sovfl scrub` / `python -m site_trainer.pii`: `run_scrub(files, cfg, ...)` (see __init__.py).

Workers are processes (regexes and phonenumbers hold the GIL) started by a forkserver that has
imported Presidio once (its import pulls spaCy, transformers and torch: ~5 s), so no worker
inherits the caller's threads (trainer ranks, gRPC) and none pays the import again. While they
start, the calling process scrubs the first documents itself, then hands the rest over. A document
that cannot be scrubbed (an exception, or slower than `doc_timeout_s`) is dropped and reported
by path, never passed on unscrubbed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from .cache import ScrubCache, content_key, surrogate_key
from .config import PiiConfig
from .report import ScrubReport
from .scrubber import DocResult, Scrubber

BATCH_BYTES = 1 << 20  # per task sent to a worker
BATCH_DOCS = 256
# Below this a run stays in the calling process: a pool costs seconds to start (the forkserver
# imports Presidio) and one core scrubs ~8 MB/s. Tests set 0 (the pool does everything).
INLINE_BYTES = int(os.environ.get("SOVFL_PII_INLINE_BYTES", 16 << 20))
_PRELOAD = ["presidio_analyzer", "presidio_anonymizer", "phonenumbers", "tldextract", "site_trainer.pii.scrubber"]


class ScrubTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise ScrubTimeout()


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class _Engine:
    """One process's scrubber and cache view; `one()` scrubs or recalls one document."""

    def __init__(self, config: PiiConfig, key: bytes | None, cache_root: Path | None, dry_run: bool):
        self.scrubber = Scrubber(config, surrogate_key=key)
        self.cache = ScrubCache(cache_root, self.scrubber.fingerprint) if cache_root is not None else None
        self.dry_run = dry_run
        self.timeout = config.doc_timeout_s

    def one(self, text: str | None, path: str, data: bytes | None = None) -> tuple[DocResult | None, bool, str | None]:
        """(result, from_cache, error). `text` None: read `path`. A detector that cannot load
        raises (a configuration error for the whole run); a document that fails is an error."""
        self.scrubber.load()
        try:
            if data is None:
                data = Path(path).read_bytes() if text is None else text.encode("utf-8", "surrogatepass")
            key = content_key(data)
            if text is None:
                text = data.decode("utf-8", errors="replace")
            if self.cache is not None:
                hit = self.cache.get(key, text)
                if hit is not None:
                    return hit, True, None
            res = self._timed(text, key)
            if self.cache is not None and not self.dry_run:
                self.cache.put(key, res, text)
            return res, False, None
        except ScrubTimeout:
            return None, False, f"not scrubbed within doc_timeout_s={self.timeout}: dropped"
        except OSError as e:
            return None, False, f"cannot read: {e.strerror or e}"
        except Exception as e:  # a detector's bug must not pass text through unscrubbed
            return None, False, f"scrubber failed ({type(e).__name__}): dropped"

    def _timed(self, text: str, key: str) -> DocResult:
        if not self.timeout or threading.current_thread() is not threading.main_thread():
            return self.scrubber.scrub(text, sample_key=key)
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return self.scrubber.scrub(text, sample_key=key)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


_ENGINE: _Engine | None = None


def _init_worker(config: PiiConfig, key: bytes | None, cache_root: Path | None, dry_run: bool,
                 fingerprint: str) -> None:
    global _ENGINE
    _ENGINE = _Engine(config, key, cache_root, dry_run)
    if _ENGINE.scrubber.fingerprint != fingerprint:
        raise RuntimeError("a worker built a different scrubber than its parent (a plug-in that is not "
                           "deterministic?): refusing to mix their outputs")


def _ready() -> bool:
    return _ENGINE is not None


def _run_batch(items: list[tuple[str, str | None]], keep_text: bool, out: tuple[str, str] | None):
    res = []
    for path, text in items:
        r, cached, err = _ENGINE.one(text, path)
        if r is not None and out is not None:
            _write_out(path, r.text, out)
        if r is not None and not keep_text and r.text is not None:
            r.text = ""  # the parent needs the counts, not the text
        res.append((r, cached, err))
    return res


def _write_out(path: str, text: str | None, out: tuple[str, str]) -> None:
    base, dest = out
    target = Path(dest) / Path(path).resolve().relative_to(Path(base).resolve())
    if text is None:
        target.unlink(missing_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8", errors="surrogatepass")


def _batches(items: Iterable[tuple[str, str | None, int]]) -> Iterator[list[tuple[str, str | None]]]:
    batch, size = [], 0
    for path, text, n in items:
        batch.append((path, text))
        size += n
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class CorpusScrubber:
    """The site's scrubber: configuration, cache, worker pool and the running report."""

    def __init__(self, config: PiiConfig, *, cache_dir: Path | None = None, workers: int | None = None,
                 site: str | None = None, dry_run: bool = False, inline_bytes: int = INLINE_BYTES):
        self.config = config
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.workers = workers or config.workers or default_workers()
        self.dry_run = dry_run
        self.inline_bytes = inline_bytes
        key = (surrogate_key(self.cache_dir, create=not dry_run)
               if config.action == "replace" and self.cache_dir is not None else None)
        self._engine = _Engine(config, key, self.cache_dir, dry_run)
        self._key = self._engine.scrubber.surrogate_key
        self.fingerprint = self._engine.scrubber.fingerprint
        self.report = ScrubReport(site=site, fingerprint=self.fingerprint, entities=config.entities,
                                  action=config.action, dry_run=dry_run, workers=self.workers,
                                  sample_per_entity=config.sample_per_entity)
        self._t0 = time.perf_counter()
        self._pool: ProcessPoolExecutor | None = None
        self._starter: threading.Thread | None = None
        self._started = threading.Event()
        self._pool_error: BaseException | None = None
        self._closing = False

    # ---- one document, in this process (the text data path's transform) ---------------------
    def __call__(self, path: str, text: str) -> str | None:
        r, cached, err = self._engine.one(text, str(path))
        return self._account(str(path), r, cached, err)

    def _account(self, path: str, r: DocResult | None, cached: bool, err: str | None) -> str | None:
        if err is not None:
            self.report.add_error(path, err)
            return None
        self.report.add(path, r, cached=cached)
        return r.text

    # ---- many documents, every core -------------------------------------------------------------
    def map(self, docs: Iterable[tuple[str, str]], *, progress: Callable[[int, int], None] | None = None,
            ) -> Iterator[tuple[str, str | None]]:
        """(path, scrubbed text or None) for each (path, text), in input order, on all workers."""
        items = ((str(p), t, len(t)) for p, t in docs)
        yield from self._run(items, keep_text=True, out=None, progress=progress)

    def scrub_files(self, paths: Iterable[Path], *, base: Path | None = None, out_dir: Path | None = None,
                    progress: Callable[[int, int], None] | None = None) -> ScrubReport:
        """Scrub files (workers read them; UTF-8, undecodable bytes replaced). With `out_dir` (and
        not a dry run) each scrubbed file is written under out_dir at its path relative to `base`;
        a dropped document's copy is removed."""
        paths = [Path(p) for p in paths]
        out = None
        if out_dir is not None and not self.dry_run and paths:
            base = Path(base) if base is not None else Path(os.path.commonpath([p.resolve().parent for p in paths]))
            outside = [str(p) for p in paths if not p.resolve().is_relative_to(base.resolve())]
            if outside:
                raise ValueError(f"files outside base {base} cannot be mirrored into {out_dir}: {outside[:3]}")
            out = (str(base), str(out_dir))
        items = []
        for p in paths:
            try:
                items.append((str(p), None, p.stat().st_size))
            except OSError as e:
                self.report.add_error(str(p), f"cannot read: {e.strerror or e}")
        for _ in self._run(iter(items), keep_text=False, out=out, progress=progress):
            pass
        return self.finish()

    def finish(self) -> ScrubReport:
        return self.report.finish(time.perf_counter() - self._t0)

    def _run(self, items: Iterator[tuple[str, str | None, int]], *, keep_text: bool, out, progress):
        """Inline below `inline_bytes`. Above: the worker pool starts in the background while this
        process scrubs, and takes over once its workers are up (start-up costs no wall time).
        `inline_bytes=0`: the pool does everything from the first document."""
        head, size = [], 0
        for it in items:
            head.append(it)
            size += it[2]
            if size >= self.inline_bytes:
                break
        stream = _chain(head, items)
        done = [0, 0]

        def account(path: str, n: int, r, cached, err):
            done[0] += 1
            done[1] += n
            if progress is not None:
                progress(done[0], done[1])
            return path, self._account(path, r, cached, err)

        if self.workers > 1 and size >= self.inline_bytes:
            self._start_pool()
        for path, text, n in stream:
            if self._starter is not None and (self.inline_bytes == 0 or self._pool_ready()):
                stream = _chain([(path, text, n)], stream)
                break
            r, cached, err = self._engine.one(text, path)
            if r is not None and out is not None:
                _write_out(path, r.text, out)
            yield account(path, n, r, cached, err)
        else:
            return
        for batch, results in self._pooled(_batches(stream), keep_text, out):
            for (path, _), (r, cached, err) in zip(batch, results):
                yield account(path, r.nbytes if r is not None else 0, r, cached, err)

    def _pooled(self, batches: Iterator[list], keep_text: bool, out):
        """(batch, results) in submission order; a batch whose worker died is retried once on a
        fresh pool, then its documents are reported as errors."""
        pending: deque = deque()
        limit = 2 * self.workers
        for batch in batches:
            pending.append((batch, self._submit(batch, keep_text, out), 0))
            while len(pending) >= limit:
                yield from self._collect(pending, keep_text, out)
        while pending:
            yield from self._collect(pending, keep_text, out)

    def _collect(self, pending: deque, keep_text: bool, out):
        batch, fut, tries = pending.popleft()
        deadline = (self.config.doc_timeout_s or 3600) * len(batch) + 120
        try:
            yield batch, fut.result(timeout=deadline)
        except (BrokenProcessPool, TimeoutError) as e:
            self._restart()
            if tries == 0:
                pending.appendleft((batch, self._submit(batch, keep_text, out), 1))
                for i in range(1, len(pending)):  # the others died with the pool
                    b, _, t = pending[i]
                    pending[i] = (b, self._submit(b, keep_text, out), t)
            else:
                why = "worker process died" if isinstance(e, BrokenProcessPool) else "worker did not answer"
                yield batch, [(None, False, f"{why} while scrubbing this batch twice: dropped")] * len(batch)

    def _start_pool(self) -> None:
        """Start the worker pool in a thread: starting a forkserver worker blocks until the
        forkserver has imported Presidio (seconds), and this process has documents to scrub."""
        if self._starter is None:
            self._started.clear()
            self._closing = False
            self._starter = threading.Thread(target=self._make_pool, name="pii-pool-start", daemon=True)
            self._starter.start()

    def _make_pool(self) -> None:
        pool = None
        try:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            pool = ProcessPoolExecutor(
                max_workers=self.workers, mp_context=ctx, initializer=_init_worker,
                initargs=(self.config, self._key, self.cache_dir, self.dry_run, self.fingerprint))
            self._pool = pool
            for f in [pool.submit(_ready) for _ in range(self.workers)]:
                f.result()
        except BaseException as e:  # surfaced by _submit; the run goes on in this process until then
            self._pool_error = e
        finally:
            self._started.set()
            if self._closing and pool is not None:  # closed while starting: nobody will use it
                pool.shutdown(wait=False, cancel_futures=True)

    def _pool_ready(self) -> bool:
        return self._started.is_set()

    def _submit(self, batch, keep_text, out):
        self._start_pool()
        self._started.wait()
        if self._pool is None:
            raise RuntimeError(f"the scrubbing worker pool did not start: {self._pool_error!r}")
        return self._pool.submit(_run_batch, batch, keep_text, out)

    def _restart(self) -> None:
        if self._starter is not None:
            self._started.wait()
        if self._pool is not None:
            for p in list((getattr(self._pool, "_processes", None) or {}).values()):
                p.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._starter = None, None

    def close(self) -> None:
        """Stop the workers (a pool still starting is let finish starting first, within a deadline,
        so that no half-started worker outlives this object)."""
        self._closing = True
        if self._starter is not None and not self._started.wait(120):
            return  # still not up: _make_pool shuts it down once it is
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._starter = None, None

    def __enter__(self) -> "CorpusScrubber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chain(head: list, rest: Iterator) -> Iterator:
    yield from head
    yield from rest
