"""``raytrain-loops submit``: run a recipe on a Ray cluster through the Ray Jobs API."""

from __future__ import annotations

import asyncio
import re
import shlex
import time
from pathlib import Path

from raytrain_loops import recipes
from raytrain_loops.config import ConfigError, load_config

EXCLUDES = [".venv", ".git", "runs", "**/__pycache__", "*.egg-info"]


def entrypoint(recipe: str, overrides: list[str], working_dir: str | None) -> str:
    """The job's command line; a recipe file must travel in ``working_dir``."""
    path = recipes.resolve(recipe)
    config = load_config(path, overrides)  # bad keys or values fail here, before anything is submitted
    if config.scaling.local:
        raise ConfigError(
            "scaling.num_workers", "a submitted job trains on the cluster's Ray: local mode (0) is `train --local` here"
        )
    arg = recipe
    if recipe not in recipes.builtin():
        if working_dir is None:
            raise ConfigError(recipe, "a recipe file needs --working-dir containing it, so the cluster can read it")
        try:
            arg = str(path.resolve().relative_to(Path(working_dir).resolve()))
        except ValueError:
            raise ConfigError(recipe, f"the recipe file is not inside --working-dir {working_dir}") from None
    return shlex.join(["python", "-m", "raytrain_loops.cli", "train", arg, *overrides])


def _submit_when_ready(client, command: str, runtime_env: dict | None, wait_s: float = 60.0) -> str:
    """Submit; a head that has just started answers "no available agent" for a while: retry that."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=command, runtime_env=runtime_env)
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def submit(
    recipe: str,
    overrides: list[str],
    address: str,
    working_dir: str | None = None,
    pip: list[str] | None = None,
    wait: bool = True,
    timeout_s: float | None = None,
) -> int:
    """Submit, then (with ``wait``) follow the job's logs and print where its results went.
    Returns 0 when the job succeeded (or was submitted, without ``wait``), 1 otherwise."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    command = entrypoint(recipe, overrides, working_dir)
    runtime_env: dict = {}
    if working_dir:
        runtime_env.update(working_dir=working_dir, excludes=EXCLUDES)
    if pip:
        runtime_env["pip"] = pip
    client = JobSubmissionClient(address)
    job_id = _submit_when_ready(client, command, runtime_env or None)
    print(f"submitted {job_id} to {address}: {command}", flush=True)
    if not wait:
        return 0

    async def follow() -> None:
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        asyncio.run(asyncio.wait_for(follow(), timeout=timeout_s))
    except (TimeoutError, asyncio.TimeoutError):
        client.stop_job(job_id)
        print(f"\njob {job_id} ran past {timeout_s:g} s and was stopped", flush=True)
    while client.get_job_status(job_id) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if deadline is not None and time.monotonic() > deadline + 30:
            break
        time.sleep(0.5)
    status = client.get_job_status(job_id)
    found = re.findall(r"^run directory: (.+)$", client.get_job_logs(job_id), flags=re.M)
    print(f"job {job_id}: {status.value}" + (f"; results in {found[-1]}" if found else ""), flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1
