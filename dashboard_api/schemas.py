"""The dashboard's JSON contract: pydantic response models, documented in ``/openapi.json``.

Only what an operator needs to see leaves the database: no token hashes, no enrollment-secret
hash, no engine state, no tensor blobs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")

RoundState = Literal["open", "closed", "abandoned"]
FederationState = Literal["running", "paused", "done"]


class Page(BaseModel, Generic[T]):
    """One page of a list that grows with rounds or clients."""

    total: int = Field(description="items matching the filters, over all pages")
    offset: int
    limit: int
    items: list[T]


class Problem(BaseModel):
    detail: str


class FederationSummary(BaseModel):
    name: str
    state: FederationState
    current_round: int = Field(description="the open round, else the last closed one (0 before the first)")
    open_round: int | None
    last_closed_round: int
    rounds_planned: int | None = Field(description="the configured number of rounds")
    clients_registered: int = Field(description="enrolled clients, revoked ones excluded")
    clients_revoked: int
    clients_online: int = Field(description="unrevoked clients heard from within heartbeat_timeout_seconds")
    heartbeat_timeout_seconds: float
    poll_seconds: float = Field(description="how often the page refreshes")
    config: dict[str, Any] = Field(description="the federation's method (FederationConfig), as stored")
    created_at: datetime
    updated_at: datetime


class FederationStateChange(BaseModel):
    name: str
    state: FederationState
    previous_state: FederationState


class EvaluationMeans(BaseModel):
    """Sample-weighted means of the clients' evaluations after a round (``None`` before any report)."""

    clients: int = 0
    mean_client_accuracy: float | None = None
    mean_client_loss: float | None = None
    personalized_accuracy: float | None = None


class RoundOut(BaseModel):
    number: int
    state: RoundState
    cohort_size: int
    reported: int
    stragglers: int = Field(description="cohort members that had not reported when the round closed")
    late_pushes: int = Field(description="pushes refused because they arrived after the round closed")
    opened_at: datetime
    closed_at: datetime | None
    deadline: datetime
    duration_seconds: float | None
    test_accuracy: float | None = Field(description="the server's evaluation of the global model")
    test_loss: float | None
    tier_accuracy: dict[str, float] = Field(
        default_factory=dict,
        description="the server's evaluation of the global model cut to each tier below 1 (what those clients run), "
        "by tier",
    )
    mean_client_accuracy: float | None = Field(description="clients' evaluations of the global model, weighted")
    personalized_accuracy: float | None = Field(
        description="clients' personalized models (personal atoms or a baseline), weighted"
    )
    evaluations: int = Field(description="clients that reported an evaluation of this round")
    dispersion: float | None = Field(
        description="client spread (within round): Σ over tensors of Σ_k p_k ‖x_k − u‖², how far the cohort's "
        "models lie from their aggregate; not the variance of the aggregated model across trainings (Prop. 5.1)"
    )
    latent_clients: int | None = Field(description="m² − m latent clients of the atom × coefficient product")
    bytes_down: int = Field(description="moved to clients for this round so far: its fetches, evaluation ones too")
    bytes_up: int = Field(description="pushed by clients in this round so far")
    fedavg_equivalent_bytes: int = Field(description="what plain FedAvg would have moved for the same transfers")


class RoundDetail(RoundOut):
    cohort: list[str]
    due: list[str] = Field(description="tensors due (aggregated) this round")
    continue_unsynced: bool
    extended: bool
    effective_dispersion: dict[str, float] = Field(
        description="per atom layer: client spread (within round) of the filters, Σ_k p_k ‖α_k × D_k − ᾱ × D̄‖²"
    )
    client_metrics: dict[str, float] = Field(description="training metrics the cohort reported, weighted")


class TensorRoundOut(BaseModel):
    name: str
    ordinal: int
    role: str | None
    interval: int = Field(description="τ_l in force")
    d_l: float | None = Field(description="FedLAMA's layer-wise unit discrepancy")
    dispersion: float | None = Field(description="client spread (within round): Σ_k p_k ‖x_k − u‖² of this tensor")
    bytes_down: int
    bytes_up: int
    version: int | None


class ClientOut(BaseModel):
    id: str
    name: str
    tier: float = Field(description="capability tier γ (rank fraction of the low-rank factors)")
    online: bool
    revoked: bool
    registered_at: datetime
    last_seen: datetime
    revoked_at: datetime | None
    rounds_joined: int
    bytes_up: int
    bytes_down: int
    last_accuracy: float | None = Field(description="last reported accuracy (personalized when reported)")


class ClientTransferOut(BaseModel):
    round: int
    bytes_down: int
    bytes_up: int


class ClientEvaluationOut(BaseModel):
    round: int
    global_accuracy: float | None
    global_loss: float | None
    personalized_accuracy: float | None
    num_samples: int
    reported_at: datetime


class ClientDetail(ClientOut):
    profile: dict[str, Any] = Field(description="the capability profile the device declared")
    transfers: list[ClientTransferOut] = Field(description="the most recent rounds it moved bytes in, newest first")
    evaluations: list[ClientEvaluationOut] = Field(description="its most recent evaluations, newest first")


class BandwidthRound(BaseModel):
    round: int
    bytes_down: int
    bytes_up: int
    bytes_train_fetch: int = Field(0, description="of bytes_down: fetches to train on")
    bytes_eval_fetch: int = Field(0, description="of bytes_down: fetches of a closed round's model to evaluate")
    bytes_push: int = Field(0, description="= bytes_up: pushed updates")
    fedavg_equivalent_bytes: int
    cumulative_bytes_down: int
    cumulative_bytes_up: int
    cumulative_fedavg_equivalent_bytes: int


class BandwidthTotals(BaseModel):
    rounds: int
    bytes_down: int
    bytes_up: int
    bytes_train_fetch: int = Field(0, description="of bytes_down: fetches to train on")
    bytes_eval_fetch: int = Field(0, description="of bytes_down: fetches of a closed round's model to evaluate")
    bytes_push: int = Field(0, description="= bytes_up: pushed updates")
    fedavg_equivalent_bytes: int
    saving_ratio: float | None = Field(description="FedAvg-equivalent bytes ÷ bytes moved (2.0: half the traffic)")
    saved_fraction: float | None = Field(description="1 − bytes moved ÷ FedAvg-equivalent bytes")


class Bandwidth(BaseModel):
    totals: BandwidthTotals
    rounds: Page[BandwidthRound]


class IntervalPoint(BaseModel):
    round: int
    interval: int
    d_l: float | None
    dispersion: float | None = Field(description="client spread (within round): Σ_k p_k ‖x_k − u‖² of this tensor")


class TensorIntervals(BaseModel):
    name: str
    ordinal: int | None = Field(
        description="the tensor's position in the model; null (and role with it) until a round has closed and "
        "recorded it: the list is then in name order"
    )
    role: str | None
    interval: int = Field(description="τ_l in force from the next round")
    version: int = Field(description="the round that last aggregated this tensor")
    history: list[IntervalPoint]


class Intervals(BaseModel):
    rounds: list[int] = Field(description="closed rounds covered by the histories (after `after`, at most `limit`)")
    tensors: list[TensorIntervals]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "unavailable"]
    database: str = Field(description="the backend (sqlite, postgresql)")
    detail: str | None = None
