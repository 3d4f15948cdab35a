"""The measured scenarios. Runs are interleaved (run 1 of every target, then run 2, ...) so that
noise on a shared machine spreads over all targets instead of hitting one.

Every save is timed the same way (`measure`): the stall is the wall time of the call, time to
durable comes from the store poller (bench.durable) started with the save, the daemon's CPU
seconds and peak RSS cover the save and its upload, and so does the CPU of the bench process
itself less its poller's (the application's torch.save, or the client library's threads).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench import gil, sysinfo
from bench.durable import Poller
from bench.figures import Results
from bench.ranks import Ranks
from bench.targets import CkptfsS3, Target

GiB = 1 << 30
MiB = 1 << 20
RANKS = 4
SMALL_FILE = 64 << 10
WRITE_CHUNK = 8 * MiB
LOAD_PREFAULT = 1.5  # times the checkpoint: the memory a load touches, pre-faulted (sysinfo)
# what save_pretrained / DCP write next to the tensors, written last
CONFIG_FILES = {
    "config.json": json.dumps(
        {
            "architectures": ["TinyLLM"],
            "hidden_size": 1024,
            "num_hidden_layers": 24,
            "torch_dtype": "bfloat16",
            "vocab_size": 32000,
        },
        indent=2,
    ),
    "generation_config.json": json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9}, indent=2),
    "tokenizer_config.json": json.dumps({"model_max_length": 4096, "padding_side": "right"}, indent=2),
    "special_tokens_map.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "vocab.txt": "\n".join(f"token{i}" for i in range(2000)),
    "latest": "step-1000\n",
}


class Progress:
    """One line per measurement, with the time since the bench started."""

    def __init__(self):
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"[{int(elapsed // 60):2d}:{int(elapsed % 60):02d}] {text}", flush=True)


@dataclass
class Bench:
    targets: dict[str, Target]
    results: Results
    progress: Progress
    runs: Callable[[str, str], int]  # (scenario, target) -> how many runs
    latest: dict[str, str] = field(default_factory=dict)  # target -> its latest single-file checkpoint
    meta: dict = field(default_factory=dict)  # facts a scenario adds to results.json's meta

    def each_run(self, scenario: str, names):
        """(run index, target) in interleaved order, skipping targets not in this run."""
        chosen = [self.targets[n] for n in names if n in self.targets]
        for i in range(max((self.runs(scenario, t.name) for t in chosen), default=0)):
            for target in chosen:
                n = self.runs(scenario, target.name)
                if i < n:
                    yield i, n, target


@dataclass
class Measured:
    stall: float
    durable: float | None  # None: no store to poll (the floor)
    cpu: float | None  # CPU seconds of the daemon and its store workers, save start to durable
    main_cpu: float | None  # of those, the daemon's own process (its main interpreter)
    rss: int | None  # its peak RSS over the same window
    extra: dict
    app_cpu: float  # CPU seconds of this process over the same window, less the poller thread's
    server_cpu: float  # CPU seconds of the S3 server over the same window

    @property
    def client_cpu(self) -> float:
        """What the client side spent: the application or library here, plus the daemon."""
        return self.app_cpu + (self.cpu or 0.0)


def measure(
    target: Target, save: Callable[[], dict], rels: list[str], known: dict[str, int] | None = None
) -> Measured:
    """Time one save of `rels` (relative paths) into `target`, with the store poller and daemon stats."""
    pid = target.pid
    if pid:
        sysinfo.reset_peak_rss(pid)
        cpu0, main0 = sysinfo.cpu_seconds(pid), sysinfo.main_cpu_seconds(pid)
    known = known or {}
    server0 = sysinfo.server_cpu_seconds()
    app0 = sysinfo.own_cpu_seconds()
    start = time.monotonic()
    poller = None
    if target.view is not None:
        poller = Poller(target.view, {target.key(r): known.get(r) for r in rels}, start)
    try:
        extra = save() or {}
        stall = time.monotonic() - start
        durable = None
        if poller is not None:
            poller.expect({target.key(r): target.saved_size(r) for r in rels if r not in known})
            durable = poller.wait()
    finally:
        if poller is not None:
            poller.cancel()
    app_cpu = sysinfo.own_cpu_seconds() - app0 - (poller.cpu if poller is not None else 0.0)
    cpu = sysinfo.cpu_seconds(pid) - cpu0 if pid else None
    main_cpu = sysinfo.main_cpu_seconds(pid) - main0 if pid else None
    rss = sysinfo.peak_rss(pid) if pid else None
    return Measured(
        stall, durable, cpu, main_cpu, rss, extra, app_cpu, sysinfo.server_cpu_seconds() - server0
    )


def _fmt(m: Measured) -> str:
    parts = [f"stall {m.stall:6.2f} s"]
    if m.durable is not None:
        parts.append(f"durable {m.durable:6.2f} s")
    if m.cpu is not None:
        parts.append(
            f"daemon {m.cpu:5.1f} CPU s (main {m.main_cpu:.1f} + workers {m.cpu - m.main_cpu:.1f}), "
            f"peak RSS {m.rss / MiB:5.0f} MiB"
        )
    return ", ".join(parts)


S3_TARGETS = (
    "ckptfs-s3",
    "ckptfs-s3-crc32c",
    "s3fs",
    "rclone",
    "boto3",
    "s3torchconnector",
)  # (talk to the server)
SAVE_TARGETS = ("cache-disk", "ckptfs-local", *S3_TARGETS)
GIL_TARGETS = ("ckptfs-local", "ckptfs-s3")  # Python daemons py-spy can sample


def _client_cpu(gib: float, app: float, daemon: float | None) -> str:
    split = f" (app {app / gib:.2f} + daemon {daemon / gib:.2f})" if daemon is not None else ""
    return f"client {(app + (daemon or 0.0)) / gib:.2f} CPU s/GiB{split}"


def one_checkpoint(bench: Bench, state, nbytes: int) -> None:
    """Save stall, time to durable, daemon CPU and RSS, then a warm load through the same target."""
    r = bench.results
    for i, n, t in bench.each_run("save", SAVE_TARGETS):
        rel = f"single/run-{i}/model.pt"
        m = measure(t, lambda t=t, rel=rel: t.save(state, rel), [rel])
        r.add("save_stall", t.name, m.stall)
        if t.name == "boto3":
            durable = m.extra["upload"]
        else:
            durable = m.durable if t.view is not None else (None if t.role == "floor" else m.stall)
        if durable is not None:
            r.add("durable", t.name, durable)
        line = f"save      {t.name:17} run {i + 1}/{n}: {_fmt(m)}"
        if t.name == "boto3":
            line += f" (serialize {m.extra['serialize']:.2f} s + upload {m.extra['upload']:.2f} s)"
        if m.cpu is not None:
            r.add("daemon_cpu", t.name, m.cpu / (nbytes / GiB))
            r.add("daemon_cpu_main", t.name, m.main_cpu / (nbytes / GiB))
            r.add("daemon_cpu_workers", t.name, (m.cpu - m.main_cpu) / (nbytes / GiB))
            r.add("daemon_rss", t.name, m.rss / MiB)
        # (the floor too: what torch.save alone costs, until it returns)
        r.add("client_cpu_save", t.name, m.client_cpu / (nbytes / GiB))
        line += "; " + _client_cpu(nbytes / GiB, m.app_cpu, m.cpu)
        if t.name in S3_TARGETS:
            r.add("server_cpu_save", t.name, m.server_cpu / (nbytes / GiB))
            line += f"; server {m.server_cpu / (nbytes / GiB):.2f} CPU s/GiB"
        if t.root is not None:
            t.settle()
            sysinfo.prefault_free_memory(int(LOAD_PREFAULT * nbytes))
            start = time.monotonic()
            t.warm_load(rel)
            r.add("warm_load", t.name, time.monotonic() - start)
            line += f"; warm load {time.monotonic() - start:.2f} s"
        bench.progress(line)
        if t.name in bench.latest:
            t.remove(os.path.dirname(bench.latest[t.name]))
        bench.latest[t.name] = rel


def cold_loads(bench: Bench, nbytes: int) -> None:
    """torch.load of each target's latest checkpoint as a fresh node sees it: a new mount with an
    empty cache (ckptfs, s3fs, rclone), the page cache dropped; boto3 downloads it instead."""
    dropped = []

    def drop():
        dropped.append(sysinfo.drop_page_cache())
        sysinfo.prefault_free_memory(int(LOAD_PREFAULT * nbytes))

    for i, n, t in bench.each_run("cold", [name for name in SAVE_TARGETS if name in bench.latest]):
        server0 = sysinfo.server_cpu_seconds()
        load = t.cold_load(bench.latest[t.name], drop)
        server = (sysinfo.server_cpu_seconds() - server0) / (nbytes / GiB)
        bench.results.add("cold_load", t.name, load.seconds)
        bench.results.add("client_cpu_cold", t.name, load.client_cpu / (nbytes / GiB))
        cpu = _client_cpu(nbytes / GiB, load.app_cpu, load.daemon_cpu)
        if load.daemon_main_cpu is not None:  # (issue 42: what the restore leaves in the GIL's process)
            main = load.daemon_main_cpu / (nbytes / GiB)
            bench.results.add("daemon_cpu_main_cold", t.name, main)
            if main > 0:
                bench.results.add("restore_ceiling", t.name, 1 / main)
            cpu += f"; daemon main {main:.2f} CPU s/GiB"
        if t.name in S3_TARGETS:
            bench.results.add("server_cpu_cold", t.name, server)
            cpu += f"; server {server:.2f} CPU s/GiB"
        bench.progress(f"cold load {t.name:17} run {i + 1}/{n}: {load.seconds:6.2f} s, {cpu}")
    if dropped and not all(dropped):
        bench.progress("  (could not drop the page cache: not root; cold loads are not cold)")


def gil_held(bench: Bench, state, nbytes: int) -> None:
    """The ckptfs daemon's GIL-held seconds per GiB over a save and its upload (save start until
    durable), sampled with py-spy (bench.gil) on saves of their own after the timed ones (the
    sampler takes CPU from the same cores); first the method's calibration on known processes.
    Without py-spy, or when it fails, the figures are left out with a one-line note."""
    chosen = [n for n in GIL_TARGETS if n in bench.targets]
    if not chosen:
        return
    work = bench.targets[chosen[0]].ctx.work
    try:
        bench.meta["gil_calibration_s"] = found = gil.calibrate(work)
    except gil.GilError as e:
        bench.progress(f"gil       no GIL-held figures: {e}")
        return
    expected = {"busy loop": gil.CALIBRATION_SECONDS, "sleeper": 0.0}
    bench.progress(
        f"gil       calibration over {gil.CALIBRATION_SECONDS:.0f} s: "
        + ", ".join(f"{k} {v:.2f} s GIL-held (expected {expected[k]:.0f})" for k, v in found.items())
    )
    for i, n, t in bench.each_run("save", chosen):
        rel = f"gil/run-{i}/model.pt"
        try:
            with gil.GilSampler(t.pid, work / f"gil-{t.name}-{i}") as sampler:
                fuse_cpu = gil.main_thread_cpu(t.pid)
                m = measure(t, lambda t=t, rel=rel: t.save(state, rel), [rel])
                fuse_cpu = gil.main_thread_cpu(t.pid) - fuse_cpu
        except gil.GilError as e:
            bench.progress(f"gil       {t.name:17} run {i + 1}/{n}: no figure: {e}")
            continue
        finally:
            t.remove(os.path.dirname(rel))
        per_gib = sampler.seconds / (nbytes / GiB)
        bench.results.add("gil_held", t.name, per_gib)
        if per_gib > 0:
            bench.results.add("projected_ceiling", t.name, 1 / per_gib)
        if off := gil.calibration_off(found):
            bench.results.note("gil_held", t.name, off)
            bench.results.note("projected_ceiling", t.name, off)
        # The trio thread answers every FUSE request: its CPU is serial whoever holds the GIL,
        # and unlike py-spy's count it does not grow while the thread waits for a core.
        serial = fuse_cpu / (nbytes / GiB)
        bench.results.add("fuse_thread_cpu", t.name, serial)
        if serial > 0:
            bench.results.add("fuse_thread_ceiling", t.name, 1 / serial)
        bench.progress(
            f"gil       {t.name:17} run {i + 1}/{n}: GIL held {sampler.seconds:.2f} s of the "
            f"{m.durable:.2f} s to durable ({per_gib:.2f} s/GiB); FUSE thread {serial:.2f} CPU s/GiB; "
            f"{_fmt(m)}"
        )


def write_path(bench: Bench, state, nbytes: int) -> None:
    """Write throughput of the FUSE write path: 8 MiB os.write calls from a buffer touched before,
    and torch.save, into the do-nothing filesystem, ckptfs and (for reference) the cache disk.
    Uploads are waited for between measurements (not timed), so one does not slow the next."""
    chunk = os.urandom(WRITE_CHUNK)
    total = max(1, nbytes // WRITE_CHUNK) * WRITE_CHUNK
    for i, n, t in bench.each_run("write", ("cache-disk", "nullfs", "ckptfs-local", "ckptfs-s3")):
        rel = f"write-{i}.bin"

        def write(rel=rel, t=t):
            fd = os.open(t.root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for _ in range(total // WRITE_CHUNK):
                    os.write(fd, chunk)
            finally:
                os.close(fd)

        m = measure(t, write, [rel])
        bench.results.add("write_tp", t.name, total / GiB / m.stall)
        save_rel = f"save-{i}.pt"
        s = measure(t, lambda t=t, rel=save_rel: t.save(state, rel), [save_rel])
        saved = (t.root / save_rel).stat().st_size
        bench.results.add("save_tp", t.name, saved / GiB / s.stall)
        bench.progress(
            f"write     {t.name:17} run {i + 1}/{n}: os.write {total / GiB / m.stall:5.2f} GiB/s, "
            f"torch.save {saved / GiB / s.stall:5.2f} GiB/s"
        )
        t.remove(rel)
        t.remove(save_rel)


SCALE_WRITERS = (1, 2, 4)
SCALE_READERS = (1, 4)


def _concurrently(jobs: list[Callable[[], None]]) -> None:
    """Run the jobs in threads at once (os.write and readinto release the GIL) and re-raise a failure."""
    errors = []

    def run(job):
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _write_file(path, nbytes: int, chunk: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nbytes // len(chunk)):
            os.write(fd, chunk)
    finally:
        os.close(fd)


def _read_file(path) -> None:
    buf = bytearray(WRITE_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def scaling(bench: Bench, nbytes: int) -> None:
    """Aggregate throughput and daemon CPU per GiB as work grows: 1, 2 and 4 threads each writing
    their own file (a checkpoint's bytes split between them) into one mount; then 1 and 4 threads
    each reading a different file from a fresh mount (empty cache, page cache dropped). Writers
    are timed to their last close; their CPU figure runs to durable (save and upload), as in the
    save scenario."""
    chunk = os.urandom(WRITE_CHUNK)
    for i, n, t in bench.each_run("scale", ("nullfs", "ckptfs-local", "ckptfs-s3")):
        line = []
        if i == 0:  # untimed: the RAM tier's slots get their pages, as for a job's second save
            measure(
                t,
                lambda t=t: _write_file(
                    t.root / "scale-warm.bin", nbytes // WRITE_CHUNK * WRITE_CHUNK, chunk
                ),
                ["scale-warm.bin"],
            )
            t.remove("scale-warm.bin")
        for k in SCALE_WRITERS:
            each = max(1, nbytes // k // WRITE_CHUNK) * WRITE_CHUNK
            rels = [f"scale-{i}-w{k}-{j}.bin" for j in range(k)]  # (nullfs has no directories)
            m = measure(
                t,
                lambda rels=rels, each=each, t=t: _concurrently(
                    [lambda rel=rel: _write_file(t.root / rel, each, chunk) for rel in rels]
                ),
                rels,
            )
            gib = each * k / GiB
            bench.results.add(f"scale_write_{k}", t.name, gib / m.stall)
            if m.cpu is not None:
                bench.results.add(f"scale_write_cpu_{k}", t.name, m.cpu / gib)
            cpu = f" ({m.cpu / gib:.2f} CPU s/GiB)" if m.cpu is not None else ""
            line.append(f"{k} writers {gib / m.stall:5.2f} GiB/s{cpu}")
        if hasattr(t, "fresh_mount"):  # cold readers: ckptfs only (a fresh mount of the same store)
            with t.fresh_mount() as mount:
                for k in SCALE_READERS:
                    writers = k if k in SCALE_WRITERS else max(SCALE_WRITERS)
                    paths = [mount.mountpoint / f"scale-{i}-w{writers}-{j}.bin" for j in range(k)]
                    sysinfo.drop_page_cache()
                    cpu0, start = sysinfo.cpu_seconds(mount.pid), time.monotonic()
                    _concurrently([lambda p=p: _read_file(p) for p in paths])
                    seconds, cpu = time.monotonic() - start, sysinfo.cpu_seconds(mount.pid) - cpu0
                    gib = sum(p.stat().st_size for p in paths) / GiB
                    bench.results.add(f"scale_read_{k}", t.name, gib / seconds)
                    bench.results.add(f"scale_read_cpu_{k}", t.name, cpu / gib)
                    line.append(f"{k} cold readers {gib / seconds:5.2f} GiB/s ({cpu / gib:.2f} CPU s/GiB)")
        bench.progress(f"scale     {t.name:17} run {i + 1}/{n}: " + ", ".join(line))
        for k in SCALE_WRITERS:
            for j in range(k):
                t.remove(f"scale-{i}-w{k}-{j}.bin")


def ram_budget_4x(bench: Bench, ctx, state, nbytes: int, make_target=CkptfsS3) -> int:
    """One ckptfs mount whose RAM tier holds a quarter of the checkpoint: its peak RSS while saving
    (and uploading) 4x the budget. Returns the budget."""
    budget = max(4 * 8 * MiB, (nbytes // 4) // MiB * MiB)
    target = make_target(ctx, ram_cache=budget, bucket="ckptfs-ram4x")
    target.name = "ckptfs-ram4x"  # its own mount and cache directories; reported as ckptfs-s3
    runs = bench.runs("ram4x", "ckptfs-s3")
    target.start()
    try:
        for i in range(runs):
            rel = f"ram4x/run-{i}/model.pt"
            m = measure(target, lambda rel=rel: target.save(state, rel), [rel])
            bench.results.add("ram_4x_rss", "ckptfs-s3", m.rss / MiB)
            bench.progress(
                f"ram 4x    {'ckptfs-s3':17} run {i + 1}/{runs}: RAM tier {budget / MiB:.0f} MiB, {_fmt(m)}"
            )
            target.remove(os.path.dirname(rel))
    finally:
        target.stop()
    bench.results.note(
        "ram_4x_rss", "ckptfs-s3", f"--ram-cache {budget // MiB} MiB, a {nbytes / MiB:.0f} MiB save"
    )
    return budget


def dcp_like(bench: Bench, shard_mib: int) -> None:
    """4 rank processes each save a shard into one checkpoint directory at once; the main process
    then writes `.metadata` (as DCP's coordinator does). Stall: until that is written."""
    names = [n for n in SAVE_TARGETS if n in bench.targets]
    if not names:
        return
    bench.progress(f"dcp       starting {RANKS} rank processes ({shard_mib} MiB shard each)")
    ranks = Ranks(RANKS, shard_mib)
    try:
        for i, n, t in bench.each_run("dcp", names):
            folder = f"dcp/run-{i}"
            shards = [f"{folder}/__{rank}_0.distcp" for rank in range(RANKS)]
            metadata = json.dumps({"shards": shards, "step": 1000 + i}).encode()
            specs = [t.rank_spec(rel) for rel in shards]

            def save(t=t, specs=specs, metadata=metadata, folder=folder):
                ranks.save(specs)
                t.write_files([(f"{folder}/.metadata", metadata)])

            m = measure(
                t, save, [*shards, f"{folder}/.metadata"], known={f"{folder}/.metadata": len(metadata)}
            )
            _record_pair(bench, "dcp", t, m)
            bench.progress(f"dcp       {t.name:17} run {i + 1}/{n}: {_fmt(m)}")
            if i + 1 < n:
                t.remove(folder)
    finally:
        ranks.close()


SLOW_SMALL = ("s3fs", "s3torchconnector")  # one request round per file, synchronous: the slowest here


def small_files(bench: Bench, count: int, slow_count: int) -> None:
    """A directory of `count` files of 64 KiB, then a few config files (json/txt), written one
    after the other as save_pretrained or DCP would. The targets in SLOW_SMALL write only the first
    `slow_count` files (and the configs); their times are scaled to `count` files (they send each
    file on its own, so their time grows linearly with the count) and say so in a note."""
    blob = os.urandom(count * SMALL_FILE)
    for i, n, t in bench.each_run("small", [n for n in SAVE_TARGETS if n in bench.targets]):
        written = min(count, slow_count) if t.name in SLOW_SMALL and slow_count else count
        folder = f"small/run-{i}"
        files = [
            (f"{folder}/shards/{k:05d}.bin", blob[k * SMALL_FILE : (k + 1) * SMALL_FILE])
            for k in range(written)
        ]
        files += [(f"{folder}/{name}", text.encode()) for name, text in CONFIG_FILES.items()]
        m = measure(
            t,
            lambda t=t, files=files: t.write_files(files),
            [rel for rel, _ in files],
            known={rel: len(data) for rel, data in files},
        )
        scale = (count + len(CONFIG_FILES)) / len(files)
        line = f"small     {t.name:17} run {i + 1}/{n}: {len(files)} files, {_fmt(m)}"
        if scale != 1:
            m.stall *= scale
            m.durable = None if m.durable is None else m.durable * scale
            note = (
                f"wrote {written} of the {count} data files (and the config files), times scaled by the file "
                f"count x{scale:.1f} (--slow-files)"
            )
            bench.results.note("small_stall", t.name, note)
            bench.results.note("small_durable", t.name, note)
            line += (
                f"; scaled x{scale:.1f} to {count + len(CONFIG_FILES)} files: {_fmt(m).split(', daemon')[0]}"
            )
        _record_pair(bench, "small", t, m)
        bench.progress(line)
        if i + 1 < n:
            t.remove(folder)


def _record_pair(bench: Bench, prefix: str, t: Target, m: Measured) -> None:
    bench.results.add(f"{prefix}_stall", t.name, m.stall)
    if t.role != "floor":
        bench.results.add(f"{prefix}_durable", t.name, m.durable if m.durable is not None else m.stall)
