"""A worker's death as a user reads it, without Ray running: Ray's real texts of each way a worker
dies (``tests/support/fixtures/ray_deaths.json``: captured from Ray by ``tests/support/fixtures/capture_ray_deaths.py``,
and the Train controller's failed health check from a real run's ``ray.log``) made into one short
line by the controller's callback, the console and the CLI, with Ray's text kept for ``ray.log``.
The run that kills a worker and reads the console is in ray/test_cli_and_api_on_ray.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError, OutOfMemoryError
from ray.train import WorkerGroupError
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

from raytrain_loops import cli
from raytrain_loops.console.capture import Console
from raytrain_loops.console.deaths import SUDDEN, death
from raytrain_loops.console.display import Display
from raytrain_loops.controller.announcer import Announcer
from tests.support.senders import Recorder

FIXTURES = json.loads((Path(__file__).resolve().parents[1] / "support" / "fixtures" / "ray_deaths.json").read_text())
TRAIN = FIXTURES["train_health_check_failed"]  # worker 1's, killed by fault.plan in a real run
CHECK, KILLED = TRAIN.split("\nThe actor died unexpectedly", 1)  # the controller's words, the actor's
KILLED = "ActorDiedError: The actor died unexpectedly" + KILLED
WORKER = f"worker 1 on node {FIXTURES['train_node_ip']} ({FIXTURES['train_node_id'][:8]})"


def actor_died(text: str) -> Exception:
    """Ray's error for a call on a dead actor, with the text Ray gave it (as captured:
    ``ActorDiedError: ...``, or ``OutOfMemoryError: ...`` for the call the memory monitor ended)."""
    name, message = text.split(": ", 1)
    if name == "OutOfMemoryError":
        return OutOfMemoryError(message)
    assert name == "ActorDiedError", name
    err = ActorDiedError()
    err.error_msg = message
    return err


def failed_check(actor_text: str) -> WorkerHealthCheckFailedError:
    """The Train controller's error for a worker whose health check met a dead actor."""
    return WorkerHealthCheckFailedError(CHECK, failure=actor_died(actor_text))


def test_the_real_runs_killed_worker_is_named_with_its_node_and_how_it_died():
    err = failed_check(KILLED)
    assert str(err) == TRAIN  # rebuilt as Ray made it
    found = death(err)
    assert found is not None and found.known
    assert found.line(1) == f"{WORKER} was killed or crashed ({SUDDEN})"


@pytest.mark.parametrize(
    ("captured", "how"),
    [
        ("actor_sigkill_while_running", f"was killed or crashed ({SUDDEN})"),
        ("actor_sigkill", f"was killed or crashed ({SUDDEN})"),
        ("actor_os_exit_1", f"was killed or crashed ({SUDDEN})"),  # Ray cannot tell it from a kill
        ("actor_sys_exit_3", "exited with code 3"),
        ("actor_node_died", "was lost with its node (the node was terminated expectedly: received SIGTERM)"),
        ("actor_oom_running", "ran out of memory (the raylet killed it: 1.5 of 23.5 GB in use on its node)"),
        ("actor_oom", "ran out of memory (the raylet killed it: 1.5 of 23.5 GB in use on its node)"),
    ],
)
def test_each_way_ray_reports_a_death_is_one_line(captured, how):
    found = death(failed_check(FIXTURES[captured]))
    assert found is not None and found.known, FIXTURES[captured]
    assert found.line(1) == f"{WORKER} {how}"
    # Without the controller's words (a bare error on the actor), the node is the actor's own.
    alone = death(actor_died(FIXTURES[captured]))
    assert alone is not None and alone.line(1).startswith("worker 1 on node 192.0.2.2") and alone.how == found.how


def test_a_worker_that_stopped_answering_its_health_checks_is_said_so():
    # Ray's own words (train/v2/_internal/execution/worker_group/worker_group.py), the real worker info.
    info = CHECK.split("Worker info: ", 1)[1]
    err = WorkerHealthCheckTimeoutError(
        "A worker health check has been hanging for 30.52 seconds. Marking the worker as dead.\n"
        f"Worker info: {info}"
    )
    found = death(err)
    assert found is not None
    assert found.line(0).endswith("stopped answering Ray's health checks for 31 s and was marked dead")


def test_an_error_a_worker_raised_is_no_death():
    assert death(RuntimeError("CUDA error: an illegal memory access")) is None
    assert death(ValueError(KILLED)) is None  # Ray's words, not Ray's error


def test_the_controller_says_a_death_once_and_leaves_the_broken_collective_it_caused_to_ray_log(tmp_path):
    sender = Recorder()
    announcer = Announcer(sender, max_failures=2)
    broken = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    announcer.after_exception(None, {0: broken, 1: failed_check(KILLED)})
    (event,) = sender.events
    assert event["text"] == f"{WORKER} was killed or crashed ({SUDDEN}); restarting from the newest checkpoint (retry 1 of 2)"
    assert "Connection closed by peer" in event["detail"] and TRAIN in event["detail"]
    assert not event["see_log"]

    shown = io.StringIO()
    with Console(str(tmp_path), display=Display(shown)) as console:
        console.display.show(console._logged(event))  # as the console's thread shows what the feed holds
    assert shown.getvalue() == event["text"] + "\n"
    log = (tmp_path / "ray.log").read_text()
    assert f"{event['text']}\nworker 0: RuntimeError: [../third_party/gloo" in log and TRAIN in log


def test_a_death_in_words_ray_did_not_use_before_shows_its_first_line_and_where_the_rest_is(tmp_path):
    sender = Recorder()
    # Ray's real text of a kill, with its cause line in words this does not know.
    details, cause = FIXTURES["actor_sigkill"].rsplit("\n", 1)
    assert cause.startswith("The actor is dead because its worker process has died.")
    unknown = f"{details}\nThe actor is dead because a new reason came up.\n\tmore: detail"
    Announcer(sender, max_failures=0).after_exception(None, {1: failed_check(unknown)})
    (event,) = sender.events
    assert event["see_log"]
    shown = io.StringIO()
    with Console(str(tmp_path), display=Display(shown)) as console:
        console.display.show(console._logged(event))
    assert shown.getvalue() == (
        f"{WORKER} died: The actor is dead because a new reason came up; no retries left (run.max_failures); "
        f"details in {tmp_path / 'ray.log'}\n"
    )
    assert "\tmore: detail" in (tmp_path / "ray.log").read_text()


def test_the_raylets_message_of_a_death_goes_to_ray_log_only(tmp_path):
    import ray._private.worker as ray_worker

    shown = io.StringIO()
    with Console(str(tmp_path), display=Display(shown)) as console:
        console.divert_forwarded()
        for message in FIXTURES["raylet_messages"]:  # as Ray's error listener hands them over
            ray_worker.print_to_stdstream({"lines": [message], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert shown.getvalue() == ""  # the controller's line says it (a Ray Data task's is retried)
    log = (tmp_path / "ray.log").read_text()
    assert all(message in log for message in FIXTURES["raylet_messages"])
    assert len(FIXTURES["raylet_messages"]) >= 2


def test_a_run_that_ends_on_a_death_says_so_in_its_last_line_without_rays_text(capsys):
    err = WorkerGroupError("[Rank 1]: ...", {1: failed_check(KILLED)})
    assert cli._failed("train", err) == 1
    out = capsys.readouterr()
    assert out.err == f"raytrain-loops: train failed: {WORKER} was killed or crashed ({SUDDEN})\n"
