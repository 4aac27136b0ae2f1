"""How hidden states travel from extraction servers to trainers: files or a Mooncake store.

`hidden_states.transport: file` (default) is vLLM's file connector: the server writes a
safetensors file per request into storage_path and the trainer reads it by path, so across
machines that path must be shared storage. `mooncake` is speculators' own distributed
transport (hs_connectors' Mooncake connector and store, `--hidden-states-backend mooncake`):
the server puts the tensors into a Mooncake store and the trainer gets them by key over TCP
or RDMA, no shared filesystem needed.

Decided once per command, like dspark_kit.distributed.rendezvous decides the multi-node launch: the
master's address and port (default node 0's train.master_addr), which node starts
`mooncake_master`, the store settings every client gets, and the address each node joins as.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.recipe import Recipe
from dspark_kit.recipe.schema import MooncakeCfg

GIB = 1024**3
LOCAL_HOSTNAME_ENV = "MOONCAKE_LOCAL_HOSTNAME"  # what hs_connectors' store joins as (else its hostname's address)
# the stock connector (GPU/NPU) and the kit's CPU subclass (engines/vllm_cpu/, on the server's PYTHONPATH)
MOONCAKE_CONNECTOR = ("MooncakeHiddenStatesConnector", "hs_connectors.mooncake_hidden_states_connector")
CPU_MOONCAKE_CONNECTOR = ("CpuMooncakeHiddenStatesConnector", "dspark_cpu_mooncake_connector")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Mooncake:
    """The Mooncake store one command's servers and trainers share."""

    host: str
    port: int
    start_on_node: int | None  # the node whose `train` (or `serve --role hidden-states`) starts mooncake_master
    # (None: it runs already, e.g. beside an external hidden_states.endpoint)
    nnodes: int
    cfg: MooncakeCfg

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def admin_port(self) -> int:
        """mooncake_master's HTTP port (/health): next to its RPC port."""
        return self.port + 1

    def master_ports(self) -> dict[str, int]:
        """The ports mooncake_master listens on, by the recipe key that sets them."""
        return {"hidden_states.mooncake.master_port": self.port,
                "hidden_states.mooncake.master_port + 1 (its HTTP port)": self.admin_port}

    @property
    def local_hostname(self) -> str:
        """The address this node's clients join the store as: loopback on one machine, else this
        host's address on the route to the master (the rendezvous's rule for --local-addr; the
        hostname's address is wrong in containers, pods and on hosts with several NICs). Each
        host's command decides its own; override: MOONCAKE_LOCAL_HOSTNAME."""
        import os

        from dspark_kit.distributed.rendezvous import route_ip

        if os.environ.get(LOCAL_HOSTNAME_ENV):
            return os.environ[LOCAL_HOSTNAME_ENV]
        if self.host in LOOPBACK:
            return "127.0.0.1"
        routed, _ = route_ip(self.host, self.port)
        return routed or socket.gethostbyname(socket.gethostname())

    def store_config(self) -> dict:
        """hs_connectors' MooncakeStoreConfig fields, for this node."""
        c = self.cfg
        return {"local_hostname": self.local_hostname, "metadata_server": c.metadata_server,
                "master_server_address": self.master, "global_segment_size": round(c.global_segment_gib * GIB),
                "local_buffer_size": round(c.local_buffer_gib * GIB), "protocol": c.protocol,
                "device_name": c.device, "num_writer_threads": 4}

    def kv_transfer_config(self, on_cpu: bool) -> dict:
        """vLLM's --kv-transfer-config for the extraction server (the kit's subclass on CPU)."""
        name, module = CPU_MOONCAKE_CONNECTOR if on_cpu else MOONCAKE_CONNECTOR
        return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"mooncake": self.store_config()}}

    def trainer_flags(self) -> list[str]:
        """speculators train's Mooncake backend flags (hs_connectors' own names)."""
        c = self.cfg
        return ["--hidden-states-backend", "mooncake", "--mooncake-master", self.master,
                "--mooncake-metadata-server", c.metadata_server, "--mooncake-protocol", c.protocol,
                *(["--mooncake-device", c.device] if c.device else []),
                "--mooncake-global-segment-gib", f"{c.global_segment_gib:g}",
                "--mooncake-local-buffer-gib", f"{c.local_buffer_gib:g}"]

    def env(self) -> dict[str, str]:
        return {LOCAL_HOSTNAME_ENV: self.local_hostname}

    def master_argv(self) -> list[str]:
        """mooncake_master from the kit's own venv (the mooncake-transfer-engine wheel ships it)."""
        return [str(Path(sys.executable).parent / "mooncake_master"), f"--rpc_port={self.port}",
                f"--metrics_port={self.admin_port}", "--enable_metric_reporting=false"]

    def node_lines(self) -> list[str]:
        """What each node does, one line per node (dry runs)."""
        lines = []
        for k in range(self.nnodes):
            starts = "starts mooncake_master, then " if k == self.start_on_node else ""
            lines.append(f"# node {k}: `dspark-kit train` {starts}its extraction server and trainer join the "
                         f"Mooncake store at {self.master} ({self.cfg.protocol}) as "
                         f"{'127.0.0.1' if self.host in LOOPBACK else f'node {k} address'} ({LOCAL_HOSTNAME_ENV})")
        return lines

    def unreachable(self, timeout: float = 3.0) -> str | None:
        """One line when nothing listens at the master's address (checked where no one starts it)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout):
                return None
        except OSError as e:
            return (f"hidden_states.mooncake: no mooncake_master at {self.master} ({e.strerror or e}); start it "
                    f"there (`mooncake_master --rpc_port={self.port}`) or set hidden_states.mooncake.start_master "
                    "so node 0's `dspark-kit train` starts it")


def mooncake_for(recipe: Recipe) -> Mooncake | None:
    """The Mooncake decision for this recipe, or None (transport file)."""
    hs, t = recipe.hidden_states, recipe.train
    if hs.transport != "mooncake":
        return None
    c = hs.mooncake
    host = c.master_host or t.master_addr
    # the command that starts the extraction server starts the master (node 0's train, or
    # `serve --role hidden-states`); with an external hidden_states.endpoint both run elsewhere
    starts = c.start_master and not hs.endpoint
    return Mooncake(host, c.master_port, 0 if starts else None, t.nnodes, c)


def transport_problems(recipe: Recipe, mooncake: Mooncake | None) -> list[str]:
    """What stops the Mooncake transport (one line each): a combination it cannot serve, or no
    master at its address when this node does not start one (`mooncake`: the command's decision)."""
    hs = recipe.hidden_states
    if hs.transport != "mooncake" or mooncake is None:
        return []
    out = []
    if hs.mode != "online":
        out.append("hidden_states.transport mooncake: only online training reads the store (offline hidden "
                   "states are files in prepared/hidden_states); set hidden_states.mode online or transport file")
    if recipe.serve.engine == "local":
        out.append("hidden_states.transport mooncake: the local engine writes files only; serve the extraction "
                   "server with serve.engine vllm or vllm-ascend")
    if not out and mooncake.start_on_node != recipe.train.node_rank and (why := mooncake.unreachable()):
        out.append(why)  # nobody here starts it: it must be up already
    return out
