"""Wire contracts shared by every service: messages, the run specification, stream names."""

from proto.base import SCHEMA_VERSION, Contract, Message, decode, encode, new_id
from proto.messages import (
    DeadLetter,
    PromptTask,
    RunEnded,
    ScoredGroup,
    ScoreDiagnostics,
    ToolCall,
    Trajectory,
    TrajectoryGroup,
    WeightsPublished,
)
from proto.runs import (
    AlgorithmSpec,
    DataSpec,
    GrpoSpec,
    ModelSpec,
    PbsdSpec,
    RolloutSpec,
    RunSpec,
    TrainerSpec,
)

__all__ = [
    "SCHEMA_VERSION",
    "AlgorithmSpec",
    "Contract",
    "DataSpec",
    "DeadLetter",
    "GrpoSpec",
    "Message",
    "ModelSpec",
    "PbsdSpec",
    "PromptTask",
    "RolloutSpec",
    "RunEnded",
    "RunSpec",
    "ScoreDiagnostics",
    "ScoredGroup",
    "ToolCall",
    "TrainerSpec",
    "Trajectory",
    "TrajectoryGroup",
    "WeightsPublished",
    "decode",
    "encode",
    "new_id",
]
