"""``python -m fsdp_exp.sync <sweep or run folders...>``: upload the offline W&B runs under them.

    python -m fsdp_exp.sync outputs/sweeps/2026-11-29_12-00-00
    python -m fsdp_exp.sync outputs/runs/a outputs/runs/b --jobs 8 --entity my-team

Every ``offline-run-*`` folder under the paths is found; folders with one W&B id are one run (a run
resumed from a checkpoint, or one whose failure the launcher noted, has several) and go up together,
oldest first, in one ``wandb sync``; several runs go up at a time. A run whose files ``wandb sync``
already marked as uploaded (``run-<id>.wandb.synced``) is skipped. The command ends with a table of
what was uploaded, skipped and failed (with the reason).

Without a network ``wandb sync`` retries for minutes, so the W&B server the settings name
(``WANDB_BASE_URL``, ``wandb login --host``) is tried first: a connection that does not open within
``--connect-timeout`` seconds fails every run at once, naming each. A run is counted as uploaded only
when ``wandb sync`` exits 0 and has marked each of its files.

Exit codes: 0 every run uploaded (or already); 1 some run was not uploaded; 2 no offline W&B run under
the paths (or a path that does not exist).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fsdp_exp.net import connect_problem

EXIT_NOT_UPLOADED = 1
EXIT_NO_RUNS = 2
SYNCED_SUFFIX = ".synced"  # wandb sync marks an uploaded run-<id>.wandb with run-<id>.wandb.synced
# W&B names an offline run's folder offline-run-<YYYYMMDD_HHMMSS>-<id>, and when that folder exists already
# (a run of the same id started within the same second: a failure noted, or a run resumed, at once) it
# appends -1, -2, ... (wandb.init's set_sync_dir_suffix). The id may hold dashes, so it is read from the
# run-<id>.wandb file inside, not from the folder's name.
_FOLDER = re.compile(r"^offline-run-(\d{8}_\d{6})-(.+)$")
_RUN_FILE = re.compile(r"^run-(.+)\.wandb$")
_RUNNING: set[subprocess.Popen] = set()  # the wandb sync processes in flight (ended on Ctrl-C)


@dataclass
class OfflineRun:
    """One W&B run: its offline files (one per attempt), oldest first."""

    run_id: str
    files: list[Path]

    @property
    def pending(self) -> list[Path]:
        return [f for f in self.files if not is_synced(f)]

    @property
    def folders(self) -> list[Path]:
        """The fsdp_exp run folders that hold its files (the one above ``wandb/``)."""
        return list(dict.fromkeys(f.parent.parent.parent for f in self.files))


@dataclass
class Outcome:
    run: OfflineRun
    status: str  # uploaded | already uploaded | failed | would upload
    detail: str = ""  # the run's address, or why it failed
    seconds: float = 0.0


def is_synced(wandb_file: Path) -> bool:
    return wandb_file.with_name(wandb_file.name + SYNCED_SUFFIX).exists()


def offline_run_id(wandb_file: Path) -> Optional[str]:
    """The W&B id of an offline run's ``run-<id>.wandb``; None for a file W&B's offline mode does not write
    (an online run's ``run-*`` folder: it went up while it ran)."""
    file_match, folder_match = _RUN_FILE.match(wandb_file.name), _FOLDER.match(wandb_file.parent.name)
    if not (file_match and folder_match):
        return None
    run_id, rest = file_match.group(1), folder_match.group(2)
    return run_id if rest == run_id or rest.startswith(f"{run_id}-") else None


def _start_key(wandb_file: Path) -> tuple[str, int, float]:
    # The folder's start time (to the second); within one second W&B's suffix (none, -1, -2, ...: the order
    # in which wandb.init found the names taken); then the file's last write (folders of one id in two run
    # folders, started in one second).
    time_spec, rest = _FOLDER.match(wandb_file.parent.name).groups()
    suffix = rest[len(offline_run_id(wandb_file)) + 1 :]
    return time_spec, int(suffix) if suffix.isdigit() else 0, wandb_file.stat().st_mtime


def find_offline_runs(paths: list[Path]) -> list[OfflineRun]:
    """The offline W&B runs at or under ``paths``, in order of their first start; each run's files oldest
    first. Raises FileNotFoundError naming a path that does not exist."""
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"no such file or folder: {', '.join(missing)}")
    found: dict[Path, None] = {}
    for path in map(Path, paths):
        candidates = [path] if path.suffix == ".wandb" else path.rglob("*.wandb")
        for file in candidates:
            # offline-run-* only: online runs went up while they ran (latest-run is a link to one of these)
            if offline_run_id(file) and file.is_file():
                found.setdefault(file.resolve(), None)
    by_id: dict[str, list[Path]] = {}
    for file in found:
        by_id.setdefault(offline_run_id(file), []).append(file)
    runs = [OfflineRun(run_id, sorted(files, key=_start_key)) for run_id, files in by_id.items()]
    return sorted(runs, key=lambda r: _start_key(r.files[0]))


# --------------------------------------------------------------------------------------- the network
def wandb_host() -> str:
    """The W&B server this machine's settings name (WANDB_BASE_URL, the settings file of ``wandb login
    --host``, else W&B's default)."""
    from wandb.sdk import wandb_setup

    return str(wandb_setup.singleton().settings.base_url)


def wandb_unreachable(timeout: float = 5.0) -> Optional[str]:
    """None when a TCP connection to the W&B server (or the proxy the environment names for it) opens
    within ``timeout`` seconds, else why not (fsdp_exp.net)."""
    url = wandb_host()
    why = connect_problem(url, timeout)
    return None if why is None else f"cannot reach the W&B server {url}: {why}"


# --------------------------------------------------------------------------------------- uploading
def _reason(output: str) -> str:
    """wandb sync's error lines, in one line (a server's HTML error page reduced to its text)."""
    lines = [re.sub(r"<[^>]+>", "", line).strip() for line in output.splitlines()]
    errors = [
        re.sub(r"^(wandb:\s*)?(ERROR|Error:)\s*", "", line)
        for line in lines
        if "ERROR" in line or line.startswith("Error")
    ]
    errors = list(dict.fromkeys(e for e in errors if e and not e.startswith("Find detailed error logs")))
    shown = [line for line in lines if line]
    return ("; ".join(errors) if errors else shown[-1] if shown else "no output")[:300]


def _end(proc: subprocess.Popen) -> None:
    """End a wandb sync and the service process it started (its own process group), gently first."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def upload(run: OfflineRun, timeout: float, extra: list[str]) -> Outcome:
    """``wandb sync`` of the run's files not yet uploaded, in one call (W&B replays files of one id in
    order of their start). Its process group is ended if it outlives ``timeout``."""
    files = run.pending
    start = time.monotonic()
    cmd = [sys.executable, "-m", "wandb", "sync", "-n", "1", *extra, *map(str, files)]
    # Its own session: wandb sync starts a service process that a timeout must end too.
    # WANDB_SILENT would hide the errors that say why an upload failed.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    _RUNNING.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        return Outcome(
            run,
            "failed",
            f"wandb sync had not finished after {timeout:g} s (stopped; raise --timeout for a large run)",
            time.monotonic() - start,
        )
    finally:
        _RUNNING.discard(proc)
    seconds = time.monotonic() - start
    unmarked = [f for f in files if not is_synced(f)]
    if proc.returncode != 0:
        return Outcome(run, "failed", f"wandb sync exit {proc.returncode}: {_reason(output)}", seconds)
    if unmarked:
        return Outcome(
            run,
            "failed",
            f"wandb sync exited 0 but left {len(unmarked)} of {len(files)} file(s) unmarked: {_reason(output)}",
            seconds,
        )
    address = re.findall(r"https?://\S+/runs/\S+", output)
    return Outcome(run, "uploaded", address[-1] if address else f"{len(files)} file(s)", seconds)


def sync(
    runs: list[OfflineRun],
    jobs: int = 4,
    timeout: float = 1800,
    connect_timeout: float = 5.0,
    extra: Optional[list[str]] = None,
    dry_run: bool = False,
) -> list[Outcome]:
    """Upload the runs not yet uploaded, ``jobs`` at a time; one Outcome per run, in the runs' order."""
    done = [Outcome(r, "already uploaded", f"{len(r.files)} file(s) marked synced") for r in runs if not r.pending]
    todo = [r for r in runs if r.pending]
    if dry_run:
        results = [Outcome(r, "would upload", f"{len(r.pending)} of {len(r.files)} file(s)") for r in todo]
    elif todo:
        why = wandb_unreachable(connect_timeout)
        if why:
            results = [Outcome(r, "failed", why) for r in todo]
        else:
            pool = ThreadPoolExecutor(max_workers=max(1, jobs))
            try:
                results = list(pool.map(lambda r: upload(r, timeout, extra or []), todo))
            finally:  # on Ctrl-C, return at once: main() ends the uploads in flight
                pool.shutdown(wait=False, cancel_futures=True)
    else:
        results = []
    order = {id(r): i for i, r in enumerate(runs)}
    return sorted(done + results, key=lambda o: order[id(o.run)])


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def print_table(outcomes: list[Outcome]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, title="W&B runs", title_justify="left")
    for column in ("W&B id", "run folder", "files", "status", "address or reason"):
        table.add_column(column, overflow="fold", no_wrap=column in ("W&B id", "files", "status"))
    for o in outcomes:
        table.add_row(
            *[
                Text(cell)
                for cell in (
                    o.run.run_id,
                    "\n".join(_shown(f) for f in o.run.folders),
                    str(len(o.run.files)),
                    o.status,
                    o.detail,
                )
            ]
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_exp.sync", description="Upload the offline W&B runs of fsdp_exp sweeps or runs."
    )
    parser.add_argument("paths", nargs="+", help="sweep folders, run folders, or their wandb/ folders")
    parser.add_argument("--jobs", "-j", type=int, default=4, help="runs uploaded at a time (default 4)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds one run's upload may take before it is stopped (default 1800)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for a connection to the W&B server before giving up (default 5)",
    )
    parser.add_argument("--entity", "-e", help="upload into this entity instead of the runs' own")
    parser.add_argument("--project", "-p", help="upload into this project instead of the runs' own")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; upload nothing")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        runs = find_offline_runs([Path(p) for p in args.paths])
    except FileNotFoundError as err:
        print(f"fsdp_exp.sync: {err}", file=sys.stderr)
        return EXIT_NO_RUNS
    if not runs:
        print(
            f"fsdp_exp.sync: no offline W&B run under {', '.join(args.paths)} (a run logs one in "
            f"<run folder>/wandb/offline-run-*/ with logger.wandb.mode=offline, the default)",
            file=sys.stderr,
        )
        return EXIT_NO_RUNS
    extra = [
        *(["--entity", args.entity] if args.entity else []),
        *(["--project", args.project] if args.project else []),
    ]
    try:
        outcomes = sync(
            runs,
            jobs=args.jobs,
            timeout=args.timeout,
            connect_timeout=args.connect_timeout,
            extra=extra,
            dry_run=args.dry_run,
        )
    except KeyboardInterrupt:
        for proc in list(_RUNNING):  # their own process groups: Ctrl-C did not reach them
            _end(proc)
        print("fsdp_exp.sync: interrupted; runs not yet marked synced are uploaded again next time", file=sys.stderr)
        return EXIT_NOT_UPLOADED
    print_table(outcomes)
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        reasons = sorted({o.detail for o in failed})
        print(
            f"fsdp_exp.sync: {len(failed)} of {len(outcomes)} W&B run(s) not uploaded: "
            f"{', '.join(f'{o.run.run_id} ({_shown(o.run.folders[0])})' for o in failed)}\n"
            f"  why: {reasons[0] if len(reasons) == 1 else 'see the table'}\n"
            f"  their files stay as they are; run this command again to upload them",
            file=sys.stderr,
        )
        return EXIT_NOT_UPLOADED
    return 0


if __name__ == "__main__":
    sys.exit(main())
