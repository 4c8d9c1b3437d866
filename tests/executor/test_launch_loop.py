"""The scheduler's launch loop on its own: merged batches, tasks run on its thread, errors kept
per request, closing, and the busy time it reports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch
from prometheus_client import CollectorRegistry

from executor_service.batch import Prepared, Segment
from executor_service.device_fault import DeviceWatch
from executor_service.engine import ForwardOutput
from executor_service.metrics import ExecutorMetrics
from executor_service.scheduler import Scheduler, SchedulerSettings
from moelora.client.errors import InvalidArgument, Unavailable


def _request(layer: int = 0, tokens: int = 4) -> Prepared:
    return Prepared(
        layer=layer,
        hidden=torch.zeros(tokens, 8),
        segments=(Segment(tokens, ""),),
        adapters=(None,),
        wanted=(),
        routing=None,
        slot_deadline=time.monotonic() + 10,
        output=torch.empty(tokens, 8),
    )


class _Answers:
    """Collects callbacks' answers, and on which thread they came."""

    def __init__(self) -> None:
        self.done = threading.Condition()
        self.got: list[tuple[ForwardOutput | None, BaseException | None, str]] = []

    def __call__(self, answer: ForwardOutput | None, error: BaseException | None) -> None:
        with self.done:
            self.got.append((answer, error, threading.current_thread().name))
            self.done.notify_all()

    def wait_for(self, count: int) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.got) >= count, 30)


class _Device:
    """A fake launch: records its batches, sleeps ``seconds``, fails any batch holding a
    3-token request."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

        self.in_run = False

    def run(
        self, requests: Sequence[Prepared], meanwhile: Callable[[], None] | None
    ) -> list[ForwardOutput]:
        self.in_run = True
        self.entered.set()
        assert self.gate.wait(30)
        if meanwhile is not None:  # as the runner does between a launch and its sync
            meanwhile()
        time.sleep(self.seconds)
        self.in_run = False
        if any(r.tokens == 3 for r in requests):
            raise InvalidArgument("3 tokens fail", "hidden_states")
        self.batches.append(len(requests))
        return [ForwardOutput(resolved_adapters=[""]) for _ in requests]


@pytest.fixture
def metrics() -> ExecutorMetrics:
    return ExecutorMetrics(CollectorRegistry())


def _scheduler(
    device: _Device, metrics: ExecutorMetrics, prepare_during_launch: bool = False
) -> Scheduler:
    return Scheduler(
        device.run,
        lambda digests: True,
        SchedulerSettings(max_batch_tokens=64, prepare_during_launch=prepare_during_launch),
        metrics,
        DeviceWatch("test device", metrics),
    )


def test_waiting_requests_leave_merged_and_a_failure_stays_its_own(
    metrics: ExecutorMetrics,
) -> None:
    device = _Device()
    device.gate.clear()  # the first launch holds the device while the others queue
    scheduler = _scheduler(device, metrics)
    answers = _Answers()
    scheduler.submit(_request(), answers)
    assert device.entered.wait(30)  # the loop took the first one alone
    for tokens in (4, 4, 3, 4):
        scheduler.submit(_request(tokens=tokens), answers)
    device.gate.set()
    answers.wait_for(5)
    scheduler.close()
    errors = [e for _, e, _ in answers.got if e is not None]
    assert len(errors) == 1 and isinstance(errors[0], InvalidArgument)
    assert all(thread == "launch-loop" for _, _, thread in answers.got)
    # The four queued requests were one batch, which failed and reran one by one.
    assert device.batches[0] == 1 and sorted(device.batches[1:]) == [1, 1, 1]


def test_each_flush_runs_once_after_all_the_answers_of_its_launch(
    metrics: ExecutorMetrics,
) -> None:
    """Requests of one launch sharing a flush (a front end's one write of their answers) get
    it once, after every answer, and a callback that raises does not skip it."""
    device = _Device()
    device.gate.clear()
    scheduler = _scheduler(device, metrics)
    events: list[str] = []

    def answered(name: str, fail: bool = False) -> Callable[..., None]:
        def done(_answer: ForwardOutput | None, _error: BaseException | None) -> None:
            events.append(name)
            if fail:
                raise RuntimeError("a broken callback")

        return done

    flushed: dict[str, threading.Event] = {"0": threading.Event(), "B": threading.Event()}

    def flush(name: str) -> Callable[[], None]:
        def run() -> None:
            events.append(f"flush {name}")
            if name in flushed:
                flushed[name].set()

        return run

    scheduler.submit(_request(), answered("first"), flush("0"))
    assert device.entered.wait(30)  # held: the next three queue and leave as one launch
    front_end_a = flush("A")  # one front end's write, for two of the requests
    scheduler.submit(_request(), answered("a", fail=True), front_end_a)
    scheduler.submit(_request(), answered("b"), flush("B"))
    scheduler.submit(_request(), answered("c"), front_end_a)
    device.gate.set()
    assert flushed["0"].wait(30) and flushed["B"].wait(30)
    scheduler.close()
    assert events[:2] == ["first", "flush 0"]
    launch = events[2:]
    assert launch[:3] == ["a", "b", "c"], "a flush ran before the launch's last answer"
    assert sorted(launch[3:]) == ["flush A", "flush B"]  # A once for its two requests
    assert device.batches == [1, 3]


def test_posted_tasks_run_on_the_loop_thread_and_close_answers_the_waiting(
    metrics: ExecutorMetrics,
) -> None:
    device = _Device()
    device.gate.clear()
    scheduler = _scheduler(device, metrics)
    answers = _Answers()
    ran_on: list[str] = []
    scheduler.post(lambda: ran_on.append(threading.current_thread().name))
    scheduler.submit(_request(), answers)
    assert device.entered.wait(30)  # the loop is inside the held launch
    scheduler.submit(_request(), answers)
    closing = threading.Thread(target=scheduler.close)
    closing.start()
    device.gate.set()
    closing.join(30)
    answers.wait_for(2)
    assert ran_on == ["launch-loop"]
    assert answers.got[0][1] is None  # the launch under way finished
    assert isinstance(answers.got[1][1], Unavailable)  # the one still waiting did not run
    with pytest.raises(Unavailable):
        scheduler.submit(_request(), answers)
    with pytest.raises(Unavailable):
        scheduler.post(lambda: None)


def test_a_failing_callback_or_task_leaves_the_loop_serving(metrics: ExecutorMetrics) -> None:
    scheduler = _scheduler(_Device(), metrics)

    def broken(answer: ForwardOutput | None, error: BaseException | None) -> None:
        raise RuntimeError("a broken callback")

    def broken_task() -> None:
        raise RuntimeError("a broken task")

    scheduler.submit(_request(), broken)
    scheduler.post(broken_task)
    answers = _Answers()
    scheduler.submit(_request(), answers)
    answers.wait_for(1)
    scheduler.close()
    assert answers.got[0][1] is None


def test_busy_time_counts_work_and_not_waiting(metrics: ExecutorMetrics) -> None:
    scheduler = _scheduler(_Device(seconds=0.3), metrics)
    answers = _Answers()
    busy = metrics.launch_loop_busy
    scheduler.submit(_request(), answers)
    answers.wait_for(1)
    time.sleep(2.0)  # idle: not busy
    scheduler.submit(_request(), answers)
    answers.wait_for(2)
    scheduler.close()  # counts the last stretch of work
    seconds = busy._value.get()
    assert 0.6 <= seconds < 1.6  # two 0.3 s launches, not the 2 s idle between them


@pytest.mark.parametrize("during", [True, False])
def test_posted_work_runs_during_a_launch_only_when_asked(
    metrics: ExecutorMetrics, during: bool
) -> None:
    device = _Device()
    device.gate.clear()
    scheduler = _scheduler(device, metrics, prepare_during_launch=during)
    answers = _Answers()
    scheduler.submit(_request(), answers)
    assert device.entered.wait(30)
    ran_in_launch: list[bool] = []
    scheduler.post(lambda: ran_in_launch.append(device.in_run))
    device.gate.set()
    answers.wait_for(1)
    scheduler.close()
    assert ran_in_launch == [during]
