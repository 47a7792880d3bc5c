"""The worker's mapping of an exception to the caller's status (worker/serving/actor.py
`_status`): by the exception's type, one line to the caller, and for a failed step the whole
traceback in the worker's own log, once per failure however many streams it ends."""
import logging

import pytest

from tinyloop.worker.model.errors import TooLong
from tinyloop.worker.serving.actor import _status


def failure() -> RuntimeError:
    try:
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore detail")
    except RuntimeError as e:
        return e


def test_a_failed_step_is_one_line_to_the_caller_and_one_traceback_in_the_log(caplog):
    e = failure()
    with caplog.at_level(logging.ERROR, logger="tinyloop.worker.serving.actor"):
        answers = [_status("worker-3", e) for _ in range(64)]  # every stream of the failed step
    assert all(a == answers[0] for a in answers)
    err = answers[0]["error"]
    assert (err["code"], err["reason"]) == ("INTERNAL", "STEP_FAILED")
    assert err["message"] == ("worker-3: a decode step failed (RuntimeError: CUDA error: operation failed due "
                              "to a previous error during capture)")
    records = [r for r in caplog.records if "a decode step failed" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info[1] is e
    assert "Traceback" in caplog.text and "more detail" in caplog.text
    with caplog.at_level(logging.ERROR, logger="tinyloop.worker.serving.actor"):
        _status("worker-3", failure())  # another failure: logged too
    assert len([r for r in caplog.records if "a decode step failed" in r.getMessage()]) == 2


@pytest.mark.parametrize("e, code, reason", [
    (ValueError("loops must be >= 1"), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (TooLong("the prompt and max_tokens pass the cache"), "INVALID_ARGUMENT", "TOO_LONG"),
])
def test_the_callers_errors_are_not_logged_as_failures(caplog, e, code, reason):
    with caplog.at_level(logging.ERROR, logger="tinyloop.worker.serving.actor"):
        err = _status("worker-0", e)["error"]
    assert (err["code"], err["reason"]) == (code, reason) and not caplog.records
