"""vLLM's file connector for extract_hidden_states, made to run on vLLM's CPU build.

This file runs INSIDE the vLLM server process (the CPU build's own venv): it
imports only vllm, torch and safetensors, never dspark_kit. The kit's plan puts
this folder on the server's PYTHONPATH and loads the class by module path
(`kv_connector_module_path`), only when vLLM runs on CPU; GPU/NPU servers keep
the stock connector.

Why: the stock `ExampleHiddenStatesConnector._submit_async_write` copies the
request's slots out of the KV cache on a CUDA stream into pinned host memory.
On CPU `pin_memory=True` raises ("requires a CUDA or other accelerator
backend") on the second engine step and the engine dies. Everything else
(scheduler side, lock files, file names, `kv_transfer_params`) is the stock
class's own; only that one method differs: the slots are copied out
synchronously (the KV cache already lives in host memory) and the file is
written before the step returns, under the same `.lock` protocol, so clients
(speculators' trainer and generate-offline-data) read it exactly as they read
the stock connector's files. The file itself is written by the class's own
`_write_tensors` (the stock one, or hs-connectors' fp8 one in
dspark_cpu_fp8_connector.py), into a temporary name that is then renamed.
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class _Done:
    """Stands in for the CUDA copy event get_finished() polls and _write_tensors waits on: the
    copy is already done."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a host-memory copy and a synchronous write."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        bs = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(bs, dtype=torch.long).reshape(1, bs) + blocks.reshape(-1, 1) * bs).flatten()
        # clone: the request's blocks are freed (and reused) once get_finished reports it done
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}

        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:  # the stock fallback: normally wait_for_save made it
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        tmp = pending.filename + ".tmp"
        try:  # a reader never sees a half-written file, even without the lock
            self._write_tensors(tensors, _Done(), tmp, None)  # the class's own write step (lock: ours, below)
            os.replace(tmp, pending.filename)
        except Exception as e:  # noqa: BLE001 - disk full etc.: like the stock writer thread, log it and
            # keep serving; the client finds no file and fails that row
            logger.error("Hidden-states write failed for req_id=%s (%s): %r", pending.req_id, pending.filename, e)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: clients waiting on the lock read the file now
        self._req_copy_events[pending.req_id] = _Done()
