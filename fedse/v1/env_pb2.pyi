from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListEnvironmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvironmentsResponse(_message.Message):
    __slots__ = ("envs", "environments")
    ENVS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedScalarFieldContainer[str]
    environments: _containers.RepeatedCompositeFieldContainer[EnvironmentInfo]
    def __init__(self, envs: _Optional[_Iterable[str]] = ..., environments: _Optional[_Iterable[_Union[EnvironmentInfo, _Mapping]]] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("name", "has_expert", "lists_actions", "max_turns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HAS_EXPERT_FIELD_NUMBER: _ClassVar[int]
    LISTS_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    name: str
    has_expert: bool
    lists_actions: bool
    max_turns: int
    def __init__(self, name: _Optional[str] = ..., has_expert: _Optional[bool] = ..., lists_actions: _Optional[bool] = ..., max_turns: _Optional[int] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("env", "split")
    ENV_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    env: str
    split: str
    def __init__(self, env: _Optional[str] = ..., split: _Optional[str] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("env", "split", "task_ids", "max_turns")
    ENV_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    env: str
    split: str
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    max_turns: int
    def __init__(self, env: _Optional[str] = ..., split: _Optional[str] = ..., task_ids: _Optional[_Iterable[int]] = ..., max_turns: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("env", "task_id")
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    env: str
    task_id: int
    def __init__(self, env: _Optional[str] = ..., task_id: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "instruction", "observation", "available_actions", "max_turns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    instruction: str
    observation: str
    available_actions: _containers.RepeatedScalarFieldContainer[str]
    max_turns: int
    def __init__(self, session_id: _Optional[str] = ..., instruction: _Optional[str] = ..., observation: _Optional[str] = ..., available_actions: _Optional[_Iterable[str]] = ..., max_turns: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "success", "available_actions", "turn", "valid_action")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    VALID_ACTION_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    done: bool
    success: bool
    available_actions: _containers.RepeatedScalarFieldContainer[str]
    turn: int
    valid_action: bool
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., success: _Optional[bool] = ..., available_actions: _Optional[_Iterable[str]] = ..., turn: _Optional[int] = ..., valid_action: _Optional[bool] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertActionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ExpertActionResponse(_message.Message):
    __slots__ = ("action",)
    ACTION_FIELD_NUMBER: _ClassVar[int]
    action: str
    def __init__(self, action: _Optional[str] = ...) -> None: ...
