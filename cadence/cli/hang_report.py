"""The hang report: every rank's heartbeat record, stack and flight-recorder dump, joined.

`build_report(folder)` reads a heartbeat folder (see `cadence.callbacks.heartbeat_dump`):

- `rank-{r}.json`: where each rank is (step, event, last progress);
- `stacks-rank-{r}.txt`: its main thread's stack at its last dump, whose frames
  `hooks-rank-{r}.json` turns into the callback and hook it is in;
- `flight-recorder-rank-{r}`: the collectives it issued, per process group,
  with their sequence numbers, and which of them had not completed.

and `analyse` compares the ranks' collectives group by group: the ranks that
wait in collective #n of a group while others never issued it, a collective
every rank issued that did not complete, and two ranks whose collective #n
differs (op, sizes or dtypes). Each finding is a `Finding`; another source of
collective records (a per-step sequence guard) adds its `Collective`s to the
ranks, or its own findings, before or after `analyse`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs

from cadence.backends.flight_recorder import DUMP_PREFIX, read_dump
from cadence.engine.events import Event

_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@attrs.frozen
class Frame:
    """One frame of a stack: file, line, function."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{_short(self.file)}:{self.line} in {self.function}"


@attrs.frozen
class Hook:
    """Where a callback's hook is in the source."""

    callback: str
    event: str
    file: str
    first: int
    last: int

    def holds(self, frame: Frame) -> bool:
        return frame.file == self.file and self.first <= frame.line <= self.last


@attrs.define
class Collective:
    """A collective a rank issued, from its flight recorder (or another record of collectives).

    Attributes:
        group: the process group's name (the same on every rank); `desc` its description.
        seq: its sequence number in that group (1 is the group's first collective).
        op: "all_reduce", "broadcast", ...
        shapes: input sizes and dtypes, as `float32[8]`.
        done: whether it completed (False: the rank was waiting in it when dumped).
        issued_by: the callback and hook that issued it, or where in the loop.
        time_ns: when it was issued (`time.time_ns()` clock).
    """

    group: str
    desc: str
    seq: int
    op: str
    shapes: str
    done: bool
    issued_by: str
    time_ns: int = 0

    def describe(self) -> str:
        return f"{self.op} #{self.seq} of group {_group(self.group, self.desc)} ({self.shapes})"


@attrs.define
class RankView:
    """What one rank left: its record, its main thread's stack, where that stack is, its collectives."""

    rank: int
    record: dict[str, Any]
    stack: list[Frame] = attrs.Factory(list)
    stack_header: str = ""
    where: str = ""
    collectives: list[Collective] = attrs.Factory(list)
    recorder: str = ""  # the flight recorder dump's state, when there is none or it is empty

    @property
    def position(self) -> tuple[int, str]:
        """(step, event) where the rank is stuck, or where its fit raised (its record keeps that after teardown)."""
        failure = self.record.get("failure") or {}
        return int(failure.get("step", self.record.get("step", 0))), str(failure.get("event", self.record.get("event")))

    def waiting(self) -> Collective | None:
        """The collective this rank waits in: its latest that had not completed."""
        pending = [c for c in self.collectives if not c.done]
        return max(pending, key=lambda c: c.time_ns) if pending else None


@attrs.frozen
class Finding:
    """One conclusion: `kind` ("missing", "incomplete", "mismatch", ...), the group and collective, the text."""

    kind: str
    group: str
    seq: int
    text: str


@attrs.define
class HangReport:
    folder: Path
    ranks: dict[int, RankView]
    findings: list[Finding] = attrs.Factory(list)


def build_report(folder: Path) -> HangReport:
    """Read every rank's files in the heartbeat `folder` and analyse them."""
    ranks: dict[int, RankView] = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
            ranks[int(record["rank"])] = RankView(int(record["rank"]), record)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for view in ranks.values():
        hooks = _read_hooks(folder / f"hooks-rank-{view.rank}.json")
        _read_stack(view, folder / f"stacks-rank-{view.rank}.txt", hooks)
        _read_flight_recorder(view, folder / f"{DUMP_PREFIX}{view.rank}", hooks)
    report = HangReport(folder, dict(sorted(ranks.items())))
    report.findings = analyse(report)
    return report


def _read_hooks(path: Path) -> list[Hook]:
    try:
        data = json.loads(path.read_text())
        return [Hook(h["callback"], h["event"], h["file"], int(h["first"]), int(h["last"])) for h in data["hooks"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _where(frames: list[Frame], hooks: list[Hook]) -> str:
    """The callback hook the innermost frames are in, else the innermost frame outside torch."""
    for frame in frames:  # innermost first
        for hook in hooks:
            if hook.holds(frame):
                return f"{hook.callback}.{hook.event}" + ("" if frame.function == hook.event else f" ({frame})")
    own = [f for f in frames if "/torch/" not in f.file and "/site-packages/" not in f.file]
    return f"the loop ({own[0]})" if own else (str(frames[0]) if frames else "?")


def _read_stack(view: RankView, path: Path, hooks: list[Hook]) -> None:
    """The main thread's stack of the last dump in `path` (faulthandler's format), and where it is."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    main = view.record.get("main_thread")
    wanted = f"0x{int(main):016x}" if isinstance(main, int) else None
    header = ""
    stacks: list[tuple[str, str, list[Frame]]] = []  # (header, thread id, frames), in file order
    for line in text.splitlines():
        if line.startswith("=== "):
            header = line[4:]
        elif match := _THREAD.match(line):
            stacks.append((header, match.group(1), []))
        elif (match := _FRAME.match(line)) and stacks:
            stacks[-1][2].append(Frame(match.group(1), int(match.group(2)), match.group(3)))
    mains = [s for s in stacks if wanted is None or s[1] == wanted]
    if mains:
        view.stack_header, _, view.stack = mains[-1]
        view.where = _where(view.stack, hooks)


def _read_flight_recorder(view: RankView, path: Path, hooks: list[Hook]) -> None:
    try:
        dump = read_dump(path.read_bytes())
    except FileNotFoundError:
        view.recorder = "no flight recorder dump (no process group, recorder off, or no dump yet)"
        return
    except Exception as exc:  # a truncated or foreign file: say so, report the rest
        view.recorder = f"unreadable flight recorder dump {path.name}: {exc}"
        return
    for entry in dump.get("entries", []):
        if entry.get("is_p2p"):
            continue  # sends and receives have their own sequence (p2p_seq_id); not compared here
        name, desc = [*(entry.get("process_group") or ("?",)), ""][:2]
        frames = [
            Frame(f.get("filename", "?"), int(f.get("line", 0)), f.get("name", "?")) for f in entry.get("frames", [])
        ]
        shapes = ", ".join(
            f"{_dtype(d)}{list(s)}" for s, d in zip(entry.get("input_sizes", []), entry.get("input_dtypes", []))
        )
        done = bool(entry.get("retired")) or entry.get("state") == "completed"
        op = str(entry.get("profiling_name", "?")).rpartition(":")[2]
        view.collectives.append(
            Collective(str(name), str(desc), int(entry.get("collective_seq_id", 0)), op, shapes or "no tensor",
                       done, _where(frames, hooks), int(entry.get("time_created_ns") or 0))
        )  # fmt: skip
    if not view.collectives:
        view.recorder = "the flight recorder holds no collective (its size was 0 when the first process group started)"


def analyse(report: HangReport) -> list[Finding]:
    """Compare the ranks' collectives group by group (see the module's docstring)."""
    findings: list[Finding] = []
    groups = sorted({c.group for view in report.ranks.values() for c in view.collectives})
    for group in groups:
        # The ranks of a group are those that recorded any of its collectives (gloo records no member list);
        # the default group ("0") is every rank with a dump.
        by_rank = {r: {c.seq: c for c in v.collectives if c.group == group} for r, v in report.ranks.items()}
        members = {r: seqs for r, seqs in by_rank.items() if seqs or (group == "0" and report.ranks[r].collectives)}
        last = {r: max(seqs, default=0) for r, seqs in members.items()}
        top = max(last.values(), default=0)
        ahead = sorted(r for r, n in last.items() if n == top)
        behind = sorted(r for r, n in last.items() if n < top)
        first = members[ahead[0]][top] if ahead else None
        if first is not None and behind:
            waiting = [r for r in ahead if not members[r][top].done]
            lags = ", ".join(f"rank {r} (its last: #{last[r]})" for r in behind)
            who = (
                f"{_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} in" if waiting else f"{_ranks(ahead)} issued"
            )
            text = f"{who} {first.describe()}, issued by {first.issued_by}; never issued by {lags}"
            findings.append(Finding("missing", group, top, text))
        elif first is not None and not all(members[r][top].done for r in ahead) and len(ahead) > 1:
            text = f"every rank issued {first.describe()}; it did not complete on {_ranks(ahead)}"
            findings.append(Finding("incomplete", group, top, text))
        common = sorted(set.intersection(*(set(seqs) for seqs in members.values()))) if members else []
        for seq in common:
            seen = {r: members[r][seq] for r in members}
            kinds = {(c.op, c.shapes) for c in seen.values()}
            if len(kinds) > 1:
                parts = "; ".join(f"rank {r}: {c.op} {c.shapes} from {c.issued_by}" for r, c in seen.items())
                findings.append(Finding("mismatch", group, seq, f"collective #{seq} of group {group} differs: {parts}"))
                break
    # The cause first: the collective whose issuing ranks stand earliest in the loop (step, then event). A rank
    # that skipped a collective went on and waits later in the loop in another one, which is a consequence;
    # when the positions tie, the oldest collective (clocks of one host, or of hosts only roughly in step).
    order = {(f.group, f.seq): _earliest(report, f.group, f.seq) for f in findings}
    return sorted(findings, key=lambda f: (f.kind != "missing", order[(f.group, f.seq)]))


def _earliest(report: HangReport, group: str, seq: int) -> tuple[int, int, int]:
    """(step, event index, time) of the earliest rank that issued collective `seq` of `group`."""
    events = [e.value for e in Event]
    keys = []
    for view in report.ranks.values():
        for c in view.collectives:
            if c.group == group and c.seq == seq:
                step, event = view.position
                keys.append((step, events.index(event) if event in events else len(events), c.time_ns))
    return min(keys, default=(0, 0, 0))


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _group(name: str, desc: str) -> str:
    return name if desc in ("", "undefined") else f"{name} ({desc})"


def _dtype(name: str) -> str:
    return {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
            "Int": "int32", "Byte": "uint8", "Bool": "bool"}.get(name, name)  # fmt: skip


def _short(file: str) -> str:
    """A path from its package or repository folder on (`cadence/engine/engine.py`, `torch/...`)."""
    for marker in ("/site-packages/", "/cadence/", "/tests/", "/examples/"):
        index = file.rfind(marker)
        if index >= 0:
            return file[index + len(marker) :] if marker == "/site-packages/" else file[index + 1 :]
    return file
