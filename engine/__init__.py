"""The trio streaming pipeline scheduler.

Imports ``states`` only; torch is imported only by the worker, tensor-channel
and capacity modules, so the scheduler core loads fast.
"""

from .actors import (
    ActorHealth,
    LocalStageActor,
    SessionContext,
    StageActor,
    StageInvocation,
    TaskKey,
)
from .blockers import Blocker, BlockerKind
from .capacity import (
    CapacityPlan,
    DeviceMemorySnapshot,
    InsufficientMemoryError,
    SessionCapacityPolicy,
    SessionMemoryBudget,
    calculate_session_capacity,
    capture_memory_snapshot,
)
from .errors import (
    ActorBusyError,
    ActorFailedError,
    EngineError,
    FatalStageError,
    IngressRefused,
    InvalidStageOutput,
    OrchestratorClosedError,
    OrchestratorCloseError,
    OutputsBusyError,
    SessionCleanupError,
    SessionExistsError,
    SessionStateError,
    StageCallTimeout,
    UnknownSessionError,
    WrongThreadError,
)
from .ingress import MAX_SEQUENCE_ID
from .metrics import (
    ArtifactStats,
    Diagnostics,
    IdleInterval,
    LatencySummary,
    SessionMetrics,
    StageTiming,
)
from .orchestrator import Orchestrator, open_orchestrator
from .parallel_actor import InProcessWorkerGroup, ParallelWorkerStageActor
from .session import Session
from .slots import SlotPool, SlotPoolFullError, SlotReleaseError
from .spec import EdgeSpec, PipelineSpec, ResourceGroupSpec, StageOrdering, StageSpec
from .workers import (
    ProcessWorkerGroup,
    WorkerCallError,
    WorkerFatalCallError,
    WorkerGroupClosed,
    WorkerGroupError,
    WorkerGroupFailed,
    WorkerStartupError,
)

__all__ = [
    "ActorBusyError", "ActorFailedError", "ActorHealth", "ArtifactStats", "Blocker", "BlockerKind", "Diagnostics",
    "EdgeSpec",
    "EngineError", "FatalStageError", "IdleInterval", "InProcessWorkerGroup", "IngressRefused",
    "InvalidStageOutput", "LatencySummary", "MAX_SEQUENCE_ID", "LocalStageActor", "Orchestrator", "OrchestratorCloseError",
    "OrchestratorClosedError", "OutputsBusyError", "ParallelWorkerStageActor", "PipelineSpec", "ResourceGroupSpec", "Session",
    "SessionCleanupError", "SessionContext", "SessionExistsError", "SessionMetrics", "SessionStateError",
    "StageActor", "StageCallTimeout", "StageInvocation", "StageOrdering", "StageSpec", "StageTiming", "TaskKey",
    "UnknownSessionError", "WrongThreadError", "open_orchestrator",
    "CapacityPlan", "DeviceMemorySnapshot", "InsufficientMemoryError", "SessionCapacityPolicy",
    "SessionMemoryBudget", "calculate_session_capacity", "capture_memory_snapshot",
    "SlotPool", "SlotPoolFullError", "SlotReleaseError",
    "ProcessWorkerGroup", "WorkerCallError", "WorkerFatalCallError", "WorkerGroupClosed", "WorkerGroupError",
    "WorkerGroupFailed", "WorkerStartupError",
]
