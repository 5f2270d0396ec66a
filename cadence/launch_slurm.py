"""SLURM launching through submitit: one task per GPU, requeue on preemption.

Used by `cadence.launch(fn, slurm=SlurmConfig(...))`; see docs/launching.md.
submitit is optional (`pip install 'cadence[slurm]'`) and imported only here,
only when a job is submitted or a requeue is asked for.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs

from cadence.run.registry import require

logger = logging.getLogger("cadence")

# Set by `slurm_requeue()` inside a submitit task; the task requeues itself
# once `fn` has returned (after the preemption checkpoint and a clean stop).
_requeue_requested = False


@attrs.define(kw_only=True)
class SlurmConfig:
    """Where and how to run a job on SLURM (or locally through submitit, for testing).

    Attributes:
        nodes: number of nodes.
        gpus_per_node: GPUs per node; one task (rank) runs per GPU.
        tasks_per_node: ranks per node; default `gpus_per_node` (or 1 on a CPU job).
        cpus_per_task: CPU cores per rank; also the worker's torch thread count.
        mem: memory per node in SLURM's syntax (`"64G"`); None: the partition's default.
        partition: SLURM partition; None: the cluster's default.
        time: time limit in minutes.
        extra: more parameters: `slurm_*` keys go to submitit as they are, other
            keys become `#SBATCH --key=value` lines (e.g. `{"constraint": "a100"}`).
        folder: where submitit writes logs and pickles (`%j` is the job id).
        job_name: the SLURM job name.
        master_port: rendezvous port on the first node; None derives one from the job id.
        max_requeues: how many times a timed-out job is requeued by submitit.
        cluster: `"slurm"`, or `"local"` to run the tasks on this machine
            with `submitit.LocalExecutor` (for tests and debugging).
        wait: block until the job ends and return rank 0's result; False
            returns the submitit `Job` right after submission.
    """

    nodes: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    gpus_per_node: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    tasks_per_node: int | None = None
    cpus_per_task: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    mem: str | None = None
    partition: str | None = None
    time: int = attrs.field(default=60, validator=attrs.validators.ge(1))
    extra: dict[str, Any] = attrs.field(factory=dict)
    folder: str = "slurm_logs/%j"
    job_name: str = "cadence"
    master_port: int | None = None
    max_requeues: int = 3
    cluster: Literal["slurm", "local"] = "slurm"
    wait: bool = True

    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 1


def submit_slurm(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    config: SlurmConfig,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Any:
    """Submit `fn` as one job of `nodes x ranks_per_node` tasks; see `cadence.launch`."""
    submitit = require("submitit", "slurm")
    executor = _executor(submitit, config)
    job_env = dict(env or {})
    if config.master_port is not None:
        job_env["MASTER_PORT"] = str(config.master_port)
    elif config.cluster == "local":
        from cadence.launch import free_port

        job_env["MASTER_PORT"] = str(free_port())
    job = executor.submit(SlurmTask(fn, args, kwargs, job_env, config.cpus_per_task))
    logger.info("submitted job %s (%d ranks) to %s", job.job_id, config.nodes * config.ranks_per_node(), config.cluster)
    if not config.wait:
        return job
    return _wait(job, config, timeout)


def _executor(submitit: Any, config: SlurmConfig) -> Any:
    if config.cluster == "local":
        if config.nodes != 1:
            raise ValueError(f"SlurmConfig(cluster='local') runs on this machine: nodes must be 1, got {config.nodes}")
        executor = submitit.LocalExecutor(folder=config.folder, max_num_timeout=config.max_requeues)
        executor.update_parameters(
            tasks_per_node=config.ranks_per_node(), gpus_per_node=config.gpus_per_node, timeout_min=config.time
        )
        return executor
    executor = submitit.AutoExecutor(folder=config.folder, cluster="slurm", slurm_max_num_timeout=config.max_requeues)
    executor.update_parameters(**slurm_parameters(config))
    return executor


def slurm_parameters(config: SlurmConfig) -> dict[str, Any]:
    """`submitit.AutoExecutor.update_parameters` arguments for `config`."""
    parameters: dict[str, Any] = {
        "name": config.job_name,
        "nodes": config.nodes,
        "tasks_per_node": config.ranks_per_node(),
        "gpus_per_node": config.gpus_per_node,
        "cpus_per_task": config.cpus_per_task,
        "timeout_min": config.time,
    }
    if config.partition:
        parameters["slurm_partition"] = config.partition
    if config.mem:
        parameters["slurm_mem"] = config.mem
    parameters.update({k: v for k, v in config.extra.items() if k.startswith("slurm_")})
    additional = {k: v for k, v in config.extra.items() if not k.startswith("slurm_")}
    if additional:
        parameters["slurm_additional_parameters"] = additional
    return parameters


def _wait(job: Any, config: SlurmConfig, timeout: float | None) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout
    while not job.done():
        if deadline is not None and time.monotonic() > deadline:
            job.cancel(check=False)
            raise TimeoutError(f"SLURM job {job.job_id}: timeout of {timeout} s passed; the job was cancelled")
        time.sleep(0.5)
    from cadence.launch import WorkerError

    ranks = config.nodes * config.ranks_per_node()
    failures = [(rank, job.task(rank).exception()) for rank in range(ranks)] if ranks > 1 else [(0, job.exception())]
    failures = [(rank, error) for rank, error in failures if error is not None]
    if failures:
        rank, error = failures[0]
        others = [r for r, _ in failures[1:]]
        also = f" (ranks {others} failed too)" if others else ""
        raise WorkerError(
            f"SLURM job {job.job_id}: rank {rank} of {ranks} failed{also}; logs in {config.folder}:\n{error}",
            rank=rank,
            traceback=str(error),
            exc_type=type(error).__name__,
        )
    return job.results()[0] if ranks > 1 else job.result()


class SlurmTask:
    """What each SLURM task runs: set the torch.distributed environment, then `fn`.

    submitit calls `checkpoint()` when the job is preempted or about to time
    out (its SIGUSR2 handler, on rank 0): returning the same task makes
    submitit requeue it, and the rerun resumes from the latest checkpoint when
    the run uses auto-resume.
    """

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], env: dict[str, str], threads: int
    ) -> None:
        self.fn, self.args, self.kwargs, self.env, self.threads = fn, args, kwargs, env, threads

    def __call__(self) -> Any:
        global _requeue_requested
        submitit = require("submitit", "slurm")
        job = submitit.JobEnvironment()
        os.environ.update(distributed_env(job, self.env, self.threads))
        import torch

        torch.set_num_threads(self.threads)
        _requeue_requested = False
        result = self.fn(*self.args, **self.kwargs)
        if _requeue_requested and job.global_rank == 0:
            # The run stopped cleanly after its preemption checkpoint: hand the
            # job back to the queue (scontrol requeue; the local executor
            # restarts its tasks on this exit code).
            job._requeue(countdown=-1)
            raise SystemExit(-1)
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def distributed_env(job: Any, env: Mapping[str, str], threads: int = 1) -> dict[str, str]:
    """torchrun's variables from a submitit `JobEnvironment` (SLURM or local)."""
    local = type(job).__name__.startswith("Local")
    hostnames = list(job.hostnames) if not local else ["127.0.0.1"]
    port = env.get("MASTER_PORT") or str(20000 + int("".join(c for c in str(job.job_id) if c.isdigit()) or 0) % 20000)
    return {
        **env,
        "MASTER_ADDR": env.get("MASTER_ADDR", hostnames[0]),
        "MASTER_PORT": port,
        "RANK": str(job.global_rank),
        "LOCAL_RANK": str(job.local_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // job.num_nodes),
        "GROUP_RANK": str(job.node),
        "OMP_NUM_THREADS": str(threads),
    }


def slurm_requeue() -> bool:
    """Put the current SLURM job back in the queue after a preemption checkpoint.

    The `Preemption` callback calls this on every rank once the forced save is
    committed and the run has stopped. Inside a `cadence.launch(slurm=...)`
    task it marks the job: when the function returns, rank 0 requeues it
    through submitit. Under plain `sbatch`/`srun` it runs `scontrol requeue
    $SLURM_JOB_ID` on rank 0 (SLURM then restarts the job, which resumes from
    the latest checkpoint with auto-resume). Outside SLURM it does nothing.

    Returns:
        True if a requeue was issued or scheduled, False outside SLURM.

    Example:
        >>> from cadence.launch import slurm_requeue
        >>> slurm_requeue()  # not on SLURM: nothing happens
        False
    """
    global _requeue_requested
    if "SUBMITIT_FOLDER" in os.environ:
        _requeue_requested = True
        return True
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return False
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
        logger.warning("requeued SLURM job %s after preemption", job_id)
    return True
