"""The driver's console without Ray: the display (a terminal and a plain log), Ray's output moved
to ray.log, and the lines rank 0 and the Train controller send. The CLI run that checks the whole
console is in ray/test_cli_and_api_on_ray.py."""

from __future__ import annotations

import io
import logging
import pickle
import threading
import warnings
from types import SimpleNamespace

import pytest
import ray
import ray._private.ray_logging as ray_logging
from ray.util.annotations import RayDeprecationWarning

from raytrain_loops import ray_private
from raytrain_loops.callbacks.run_log import RunLog
from raytrain_loops.console.capture import Console
from raytrain_loops.console.display import Display
from raytrain_loops.controller.announcer import Announcer
from raytrain_loops.sweeps.tune import TrialProgress, _Decisions
from tests.support.senders import Recorder


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress(step: int, total: int = 63) -> dict:
    return {"kind": "progress", "text": f"step {step}/{total} | loss 0.5", "step": step, "total": total}


def test_without_a_terminal_every_event_is_a_plain_line():
    out = io.StringIO()
    display = Display(out)
    for event in [progress(5), progress(10), {"kind": "eval", "text": "eval at step 21: eval_accuracy 0.9"}]:
        display.show(event)
    display.close()
    assert out.getvalue() == "step 5/63 | loss 0.5\nstep 10/63 | loss 0.5\neval at step 21: eval_accuracy 0.9\n"


def test_on_a_terminal_the_progress_is_one_bar_redrawn_in_place_with_other_events_above_it():
    out = Terminal()
    display = Display(out)
    display.show(progress(5))
    display.show(progress(10))
    display.show({"kind": "checkpoint", "text": "checkpoint at step 21: /runs/x/checkpoint_00000021"})
    display.show(progress(30))
    display.close()
    text = out.getvalue()
    assert display.live and "step 10/63 | loss 0.5" in text
    # The bar is redrawn with carriage returns; only the lines above it and the end close a line.
    lines = text.split("\n")
    assert lines[0].endswith("checkpoint at step 21: /runs/x/checkpoint_00000021")
    assert "step 5/63" in lines[0] and "step 10/63" in lines[0]  # drawn over, not new lines
    assert lines[1].rstrip().endswith("step 30/63 | loss 0.5") and lines[2] == ""
    assert "30/63" not in lines[0]


def test_ray_loggers_and_warnings_go_to_ray_log_and_come_back_after(tmp_path, capfd):
    ray_logger = logging.getLogger("ray.train")
    before = (list(logging.getLogger("ray").handlers), logging.getLogger("ray").propagate)
    with warnings.catch_warnings(record=True) as shown, Console(str(tmp_path), display=Display(io.StringIO())):
        warnings.simplefilter("always")
        ray_logger.warning("Requesting resources: {'CPU': 1.0} * 2")
        warnings.warn("`ExecutionOptions.exclude_resources` is deprecated", RayDeprecationWarning, stacklevel=1)
        warnings.warn("a user's own warning", UserWarning, stacklevel=1)
    seen = capfd.readouterr()
    log = (tmp_path / "ray.log").read_text()
    assert "Requesting resources" in log and "RayDeprecationWarning" in log
    assert "Requesting resources" not in seen.out + seen.err and "RayDeprecationWarning" not in seen.out + seen.err
    assert [str(w.message) for w in shown] == ["a user's own warning"] and "a user's own warning" not in log
    assert (list(logging.getLogger("ray").handlers), logging.getLogger("ray").propagate) == before


def test_verbose_leaves_rays_output_alone(tmp_path):
    ray_logger = logging.getLogger("ray")
    before = list(ray_logger.handlers)
    with Console(str(tmp_path), verbose=True, display=Display(io.StringIO())):
        assert ray_logger.handlers == before and before  # Ray's own handler, printing as it does
    assert not (tmp_path / "ray.log").exists()


def test_forwarded_output_goes_to_ray_log_except_this_projects_warnings(tmp_path):
    out = io.StringIO()
    with Console(str(tmp_path), display=Display(out)) as console:
        console._forwarded(  # what Ray's log monitor hands the driver for a batch of a process's lines
            {
                "pid": 123,
                "ip": "10.0.0.2",
                "actor_name": "RayTrainWorker",
                "is_err": False,
                "lines": [
                    "Reporting training result 1: TrainingReport(checkpoint=None, metrics={'loss': 0.5})",
                    "\x1b[33mwarning: checkpoint /r/checkpoint_00000018 is unusable, trying the one before\x1b[0m",
                ],
            }
        )
    log = (tmp_path / "ray.log").read_text()
    assert "(RayTrainWorker pid=123, ip=10.0.0.2) Reporting training result 1: TrainingReport(" in log
    assert "warning: checkpoint /r/checkpoint_00000018 is unusable" in log and "\x1b[" not in log
    assert out.getvalue() == "warning: checkpoint /r/checkpoint_00000018 is unusable, trying the one before\n"


def test_the_raylets_messages_go_to_ray_log_and_rays_printer_comes_back_after(tmp_path, capfd):
    import ray._private.worker as ray_worker

    rays = ray_worker.print_to_stdstream
    raylet = {"pid": "raylet", "is_err": False, "lines": ["WARNING: 12 PYTHON worker processes have been started"]}
    oom = {"pid": "raylet", "is_err": False, "lines": ["1 Workers killed due to memory pressure (OOM)"]}
    shown = io.StringIO()
    with Console(str(tmp_path), display=Display(shown)) as console:
        console.divert_forwarded()  # what start() does once Ray is up
        ray_worker.print_to_stdstream(raylet, ignore_prefix=False)  # as Ray's error listener calls it
        ray_worker.print_to_stdstream(oom, ignore_prefix=False)
        ray_worker.print_to_stdstream({"pid": 7, "is_err": False, "lines": ["a worker's own line"]}, False)
    seen = capfd.readouterr().out
    log = (tmp_path / "ray.log").read_text()
    assert "(raylet pid=raylet) WARNING: 12 PYTHON worker processes" in log and "killed due to memory" in log
    assert "12 PYTHON" not in seen + shown.getvalue() and "a worker's own line" in seen  # else: as Ray prints it
    # What a user must see: a message in a shape the console does not know, its first line and where the rest is.
    assert shown.getvalue() == f"(raylet) 1 Workers killed due to memory pressure (OOM); details in {tmp_path / 'ray.log'}\n"
    assert ray_worker.print_to_stdstream is rays


class ClosedPipe(io.StringIO):
    """A terminal gone: every write fails, as a closed pipe's does."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_raylet_message_the_display_cannot_show_never_stops_rays_error_listener(tmp_path):
    import ray._private.worker as ray_worker

    messages = [
        "1 Workers killed due to memory pressure (OOM)",  # shown: the display raises
        None,  # not text
        "2 Workers killed due to memory pressure (OOM)",
    ]
    heard: list = []

    def listen_error_messages() -> None:  # Ray's listener: a loop on its thread that an exception ends
        for message in messages:
            ray_worker.print_to_stdstream({"lines": [message], "pid": "raylet", "is_err": False}, ignore_prefix=False)
            heard.append(message)

    with Console(str(tmp_path), display=Display(ClosedPipe(), live=False)) as console:
        console.divert_forwarded()
        listener = threading.Thread(target=listen_error_messages, name="ray_listen_error_messages")
        listener.start()
        listener.join(10)
    assert heard == messages  # the listener went on past every message
    log = (tmp_path / "ray.log").read_text()
    assert "(raylet pid=raylet) 1 Workers killed" in log and "(raylet pid=raylet) 2 Workers killed" in log
    assert log.count("console: a message of the raylet could not be shown (BrokenPipeError: ") == 2
    assert log.count("console: a message of the raylet could not be shown (TypeError: ") == 1


class ChangedDispatcher:
    """Ray's dispatcher of forwarded output as another Ray version might keep it: its handlers by
    name, under another lock. It starts with Ray's own handler, ``rays``."""

    def __init__(self, rays):
        self.by_name = {"ray_print_logs": rays}
        self._mutex = threading.Lock()

    def add_handler(self, name, handler) -> None:
        self.by_name[name] = handler

    def remove_handler(self, name) -> None:
        self.by_name.pop(name, None)

    def emit(self, data) -> None:
        for handler in list(self.by_name.values()):
            handler(data)


class AddHandlerChanged(ray_logging.WorkerStandardStreamDispatcher):
    """Ray's own dispatcher class with another signature of ``add_handler``, starting with Ray's
    own handler, ``rays``."""

    def __init__(self, rays):
        super().__init__()
        super().add_handler("ray_print_logs", rays)

    def add_handler(self, handler, *, name: str) -> None:
        super().add_handler(name, handler)


BATCH = {"pid": 7, "actor_name": "RayTrainWorker", "lines": ["Reporting training result 3"]}


@pytest.mark.parametrize("changed", [ChangedDispatcher, AddHandlerChanged])
def test_a_changed_ray_dispatcher_leaves_rays_own_output_in_place(tmp_path, monkeypatch, changed):
    printed: list = []
    dispatcher = changed(printed.append)  # Ray's own printing of forwarded output
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    monkeypatch.setattr(ray_private, "_said", set())
    with Console(str(tmp_path), display=Display(io.StringIO())) as console:
        console.divert_forwarded()
        dispatcher.emit(BATCH)
    assert printed == [BATCH]  # shown as Ray prints it, not lost
    log = (tmp_path / "ray.log").read_text()
    said = {  # the door's line where a part it names is gone; the console's where a call fails
        ChangedDispatcher: f"ray {ray.__version__}: ray._private.ray_logging.global_worker_stdstream_dispatcher._lock "
        "is missing (serves the console: the workers' forwarded output moved to ray.log",
        AddHandlerChanged: "console: Ray's forwarded output is shown as Ray prints it",
    }[changed]
    assert log.count(said) == 1 and "Reporting training" not in log


def test_a_batch_the_console_cannot_handle_never_stops_the_forwarding(tmp_path, monkeypatch):
    dispatcher = ray_logging.WorkerStandardStreamDispatcher()  # Ray's own, as in this Ray version
    printed: list = []
    dispatcher.add_handler("ray_print_logs", printed.append)
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    with Console(str(tmp_path), display=Display(io.StringIO())) as console:
        console.divert_forwarded()
        # Ray's log thread calls emit in a loop that an exception ends, with all forwarding.
        dispatcher.emit({"pid": 7, "lines": [None]})  # a line that is not text
        dispatcher.emit({"pid": 8, "lines": 3})  # nor a list of lines
        dispatcher.emit(BATCH)
    log = (tmp_path / "ray.log").read_text()
    assert log.count("console: a batch of forwarded output could not be shown (TypeError: ") == 2
    assert "(RayTrainWorker pid=7) Reporting training result 3" in log and printed == []
    dispatcher.emit(BATCH)  # Ray's own handler is back after the run
    assert printed == [BATCH]


def test_the_controller_announces_checkpoints_and_each_failure_with_what_follows():
    sender = Recorder()
    announcer = Announcer(sender, max_failures=1)

    class Saved:
        path = "/runs/x/checkpoint_00000021"

    announcer.after_report(None, [{"step": 21, "loss": 0.3}, {"step": 21}], Saved())
    announcer.after_report(None, [{"step": 30}], None)
    announcer.after_exception(None, {1: RuntimeError("CUDA error: an illegal memory access")})
    announcer.after_exception(None, {0: ValueError("bad batch")})
    assert [e["text"] for e in sender.events] == [
        "checkpoint at step 21: /runs/x/checkpoint_00000021",
        "worker 1 failed: RuntimeError: CUDA error: an illegal memory access; "
        "restarting from the newest checkpoint (retry 1 of 1)",
        "worker 0 failed: ValueError: bad batch; no retries left (run.max_failures)",
    ]


def test_rank_0_sends_its_progress_and_evaluation_lines_to_the_driver(tmp_path):
    log = RunLog(str(tmp_path), rank=0, total_steps=63, progress=True)
    log.sender = Recorder()
    log.on_interval({"loss": 0.5, "lr": 1e-3, "epoch": 0}, 10)
    log.on_eval({"eval_accuracy": 0.9}, 21, 1)
    log.close()
    kinds = [(e["kind"], e.get("step"), e.get("total")) for e in log.sender.events]
    assert kinds == [("progress", 10, 63), ("eval", 21, None)]
    assert log.sender.events[0]["text"].startswith("step 10/63 (16%)")
    assert log.sender.events[1]["text"] == "eval at step 21: eval_accuracy 0.9000"


def test_a_sweep_prints_a_line_per_trial_result_and_how_each_trial_ended():
    out = io.StringIO()
    lines = TrialProgress(Display(out), "eval_accuracy", length=63)
    trial = SimpleNamespace(trial_id="3f2a_00001", last_result={"step": 20, "eval_accuracy": 0.5}, error_file=None)
    lines.on_trial_result(0, [], trial, {"step": 20, "eval_accuracy": 0.5})
    lines.on_trial_complete(0, [], trial)  # ASHA stopped it before its 63 steps
    trial.last_result = {"step": 63, "eval_accuracy": 0.91}
    lines.on_trial_complete(0, [], trial)
    decisions = _Decisions(Display(out))
    record = logging.LogRecord("ray.tune.schedulers.pbt", logging.INFO, "", 0, "", None, None)
    record.msg = "\n\n[PopulationBasedTraining] [Exploit] Cloning trial a (score = 0.9) into trial b (score = 0.1)\n"
    decisions.emit(record)
    assert out.getvalue().splitlines() == [
        "trial_00001 step 20: eval_accuracy 0.5",
        "trial_00001 stopped by the scheduler at step 20: eval_accuracy 0.5",
        "trial_00001 finished at step 63: eval_accuracy 0.91",
        "[PopulationBasedTraining] [Exploit] Cloning trial a (score = 0.9) into trial b (score = 0.1)",
    ]
    assert pickle.loads(pickle.dumps(lines)).display is None  # Tune pickles its callbacks with the sweep
