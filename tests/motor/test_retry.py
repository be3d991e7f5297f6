"""motor/service/retry.py: the capped backoff and the one-report-per-spell rule every retry loop uses."""

from __future__ import annotations

from motor.service.retry import RepeatedFailure, backoff_delay, worth_reporting


def test_the_backoff_doubles_up_to_its_cap_and_jitter_stays_below_it():
    assert [backoff_delay(n, 0.5, 5.0) for n in range(0, 8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    assert backoff_delay(10_000, 1.0, 30.0) == 30.0  # no overflow however long it fails
    for n in (1, 3, 50):
        assert all(0.0 <= backoff_delay(n, 1.0, 8.0, jitter=True) <= min(8.0, 2.0 ** (n - 1)) for _ in range(50))


def test_a_spell_of_failures_is_reported_at_its_start_and_at_powers_of_ten():
    assert [n for n in range(1, 2001) if worth_reporting(n)] == [1, 10, 100, 1000]
    failure = RepeatedFailure(base=1.0, cap=4.0)
    reports, delays = [], []
    for attempt in range(12):
        if failure.failed(f"error {attempt}"):
            reports.append(failure.count)
        delays.append(failure.delay())
    assert reports == [1, 10] and failure.last_error == "error 11"
    assert delays == [1.0, 2.0, 4.0] + [4.0] * 9  # grows to its cap, then stays
    assert failure.recovered() == 12 and failure.count == 0 and failure.delay() == 0.0
    assert failure.failed("again") and failure.count == 1  # a new spell is reported again


class Flaky(Exception):
    pass


async def test_with_retries_tries_again_after_a_retryable_error_only_and_waits_the_backoff():
    from motor.service.retry import with_retries

    waits, tries = [], []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def call(errors: list) -> str:
        tries.append(1)
        if errors:
            raise errors.pop(0)
        return "done"

    errors = [Flaky(), Flaky()]
    assert await with_retries(lambda: call(errors), 4, lambda e: isinstance(e, Flaky), 0.1, 2.0, sleep) == "done"
    assert len(tries) == 3 and waits == [0.1, 0.2]

    tries.clear(), waits.clear()
    errors = [Flaky()] * 10
    try:
        await with_retries(lambda: call(errors), 4, lambda e: isinstance(e, Flaky), 0.1, 0.3, sleep)
        raise AssertionError("the last error must come out")
    except Flaky:
        pass
    assert len(tries) == 4 and waits == [0.1, 0.2, 0.3]  # capped; no wait after the last try

    tries.clear(), waits.clear()
    errors = [ValueError("refused")]
    try:
        await with_retries(lambda: call(errors), 4, lambda e: isinstance(e, Flaky), 0.1, 2.0, sleep)
        raise AssertionError("a refusal must come out at once")
    except ValueError:
        pass
    assert len(tries) == 1 and waits == []
