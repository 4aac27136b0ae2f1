"""A stop that lands while the trainer writes a log line must still reach speculators' save.

speculators answers SIGTERM and SIGINT by raising TrainingInterruptedError, an Exception, from its
signal handler, wherever the main thread happens to be, and from then on ignores the signal (it
counts itself interrupted; graceful_shutdown.py). When the main thread is inside a log handler's
write (rich's RichHandler prints every metrics line, a fair share of a short step), logging's own
`except Exception: self.handleError(record)` catches the error: "--- Logging error ---" is printed
and training runs on, deaf to every later SIGTERM. The kit SIGKILLs it after train's grace and the
`interrupted` save is lost, or a short epoch ends as if nobody had asked it to stop (seen once in
a CI run of tests/test_train_interrupt.py). The patch lets that one error through handleError.
"""

from __future__ import annotations

import logging
import sys

from dspark_kit.compat.device_fixes import Replacements


def _interrupt_error() -> type[Exception]:
    from speculators.train.graceful_shutdown import TrainingInterruptedError

    return TrainingInterruptedError


class _InterruptedWhileWriting(logging.Handler):
    """A handler whose write the stop lands in, caught as logging.StreamHandler and RichHandler catch it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            raise _interrupt_error()("SIGTERM")
        except Exception:  # noqa: BLE001 - what the stock handlers do
            self.handleError(record)


def probe_stop_in_log_write(device: str) -> tuple[bool, str]:
    interrupted = _interrupt_error()
    logger = logging.getLogger("dspark_kit.probe.stop_in_log_write")
    logger.propagate = False
    handler = _InterruptedWhileWriting()
    logger.addHandler(handler)
    loud = logging.raiseExceptions
    logging.raiseExceptions = False  # a swallowed probe error prints no "--- Logging error ---"
    try:
        logger.warning("the line a stop lands in")
    except interrupted:
        return True, "a stop during a log write reaches speculators' interrupted save"
    finally:
        logging.raiseExceptions = loud
        logger.removeHandler(handler)
    return False, "logging's handleError swallows TrainingInterruptedError: a stop during a log write is lost"


def patch_stop_in_log_write(device: str) -> Replacements:
    interrupted = _interrupt_error()
    original = logging.Handler.handleError

    def handle_error(self: logging.Handler, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]  # handleError runs inside the handler's `except` block
        if isinstance(error, interrupted):
            raise error
        original(self, record)

    return [(logging.Handler, "handleError", handle_error)]
