"""Client host configuration: a client agent's settings, which every member shares, and which members
the host holds (flags and FEDSE_* variables)."""

from __future__ import annotations

import dataclasses

from fedse.config import ConfigError, field
from fedse.splits import member_id

from services.client_agent.config import ClientConfig

# The ClientConfig fields that are the host's, not a member's: the host serves health and metrics once.
HOST_ONLY = ("address", "metrics_port", "reset_privacy_ledger")


@dataclasses.dataclass(frozen=True)
class HostConfig(ClientConfig):
    """A Fed-SE client host: many client agents in one process over one base model.

    Each member is a client of its own (its id, state directory, buffer, adapter, gRPC session with the
    aggregator and the env server, privacy ledger); they share the base model and its LoRA wrapper, and
    every client setting below. Member k (k = --member-offset, --member-offset + --member-stride, ...,
    --members of them) is client `<--client-id>-<k>`, k zero-padded to two digits or the width of
    --members-total."""

    client_id: str = field("client", "the members' id prefix: member k is client '<prefix>-<k>' (k zero-padded to "
                                     "two digits or more)")
    address: str = field("0.0.0.0:50070", "this host's gRPC health address (port 0 picks one)")
    state_dir: str = field("state/client", "directory holding each member's state directory (<state-dir>/<id>/)")
    members: int = field(1, "how many client agents this host runs")
    member_offset: int = field(0, "the first member's number k (a StatefulSet pod with ordinal i: i)")
    member_stride: int = field(1, "the step between this host's member numbers (H pods sharing a federation: H, "
                                  "so that pod i holds members i, i+H, i+2H, ...)")
    members_total: int = field(0, "the members of every host together, for the ids' width and the task shares "
                                  "(member k of T explores share k/T of each environment's training tasks, where "
                                  "the client has --task-share); 0 = this host's last member number + 1")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.members < 1:
            raise ConfigError(f"--members must be at least 1, got {self.members}")
        if self.member_offset < 0 or self.member_stride < 1:
            raise ConfigError(f"--member-offset must be 0 or more and --member-stride at least 1, got "
                              f"{self.member_offset} and {self.member_stride}")
        if self.members_total and self.numbers()[-1] >= self.members_total:
            raise ConfigError(f"--members-total {self.members_total} is too small for member number "
                              f"{self.numbers()[-1]} (--member-offset {self.member_offset}, --member-stride "
                              f"{self.member_stride}, --members {self.members})")
        if self.guardian:
            raise ConfigError("--guardian sizes one client's rank and precision to its machine; a client host's "
                              "members share one model, so they share --lora-r and --precision: give them instead")
        if self.reset_privacy_ledger:
            raise ConfigError("--reset-privacy-ledger resets one client's ledger: run `fedse client --client-id ID "
                              "--reset-privacy-ledger` for each member whose ledger is to be reset")
        if self.tls_cert or self.tls_key:
            raise ConfigError("--tls-cert names one client (the aggregator admits a certificate as the client it names "
                              "only): a client host's members authenticate with --token-file, and --tls-ca verifies "
                              "the servers")
        if not self.client_id:
            raise ConfigError("--client-id (the members' id prefix) is empty")

    def numbers(self) -> list[int]:
        """The member numbers k this host holds."""
        return [self.member_offset + i * self.member_stride for i in range(self.members)]

    @property
    def total(self) -> int:
        return self.members_total or self.numbers()[-1] + 1

    def member_id(self, k: int) -> str:
        return member_id(self.client_id, k, self.total)

    def member(self, k: int) -> ClientConfig:
        """Member k's client config: these settings, its id and its share of each environment's training
        tasks (member k of --members-total)."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(ClientConfig)}
        return ClientConfig(**{**settings, "client_id": self.member_id(k), "task_share": f"{k}/{self.total}"})

    def member_configs(self) -> list[ClientConfig]:
        return [self.member(k) for k in self.numbers()]
