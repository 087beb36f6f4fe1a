"""EnvService over a SessionManager: protobuf in and out, domain errors mapped to status codes."""

from __future__ import annotations

import grpc

from fedse.env import EnvironmentFailed, EnvironmentUnavailable, EpisodeLost
from fedse.transport.inputs import InputError, bounded
from fedse.transport.serving import StatusMap
from fedse.v1 import env_pb2, env_pb2_grpc

from .sessions import (
    BadAction,
    BadSplit,
    EnvServerError,
    EpisodeDone,
    NoExpertHere,
    SessionManager,
    TooManySessions,
    UnknownEnvironment,
    UnknownSession,
    UnknownTaskId,
)

SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name

ERRORS = StatusMap([
    (UnknownSession, grpc.StatusCode.NOT_FOUND),
    (UnknownEnvironment, grpc.StatusCode.NOT_FOUND),
    (UnknownTaskId, grpc.StatusCode.NOT_FOUND),
    (TooManySessions, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BadSplit, grpc.StatusCode.INVALID_ARGUMENT),
    (BadAction, grpc.StatusCode.INVALID_ARGUMENT),
    (EpisodeDone, grpc.StatusCode.FAILED_PRECONDITION),
    (NoExpertHere, grpc.StatusCode.UNIMPLEMENTED),
    # An environment that stands for an outside service (an AgentGym bridge).
    (EnvironmentUnavailable, grpc.StatusCode.UNAVAILABLE),
    (EnvironmentFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (EpisodeLost, grpc.StatusCode.NOT_FOUND),
    (InputError, grpc.StatusCode.INVALID_ARGUMENT),
    (EnvServerError, grpc.StatusCode.INTERNAL),
])


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, manager: SessionManager):
        self.manager = manager

    @ERRORS.wrap
    def ListEnvironments(self, request, context):
        envs = self.manager.environments()
        return env_pb2.ListEnvironmentsResponse(envs=[e.name for e in envs], environments=[
            env_pb2.EnvironmentInfo(name=e.name, has_expert=e.has_expert, lists_actions=e.lists_actions,
                                    max_turns=e.max_turns) for e in envs])

    @ERRORS.wrap
    def ListTasks(self, request, context):
        task_ids, max_turns = self.manager.list_tasks(bounded("env", request.env), bounded("split", request.split))
        return env_pb2.ListTasksResponse(env=request.env, split=request.split, task_ids=task_ids,
                                         max_turns=max_turns)

    @ERRORS.wrap
    def Reset(self, request, context):
        r = self.manager.reset(bounded("env", request.env), request.task_id)
        return env_pb2.ResetResponse(session_id=r.session_id, instruction=r.instruction, observation=r.observation,
                                     available_actions=r.available_actions, max_turns=r.max_turns)

    @ERRORS.wrap
    def Step(self, request, context):
        s = self.manager.step(bounded("session_id", request.session_id), request.action)
        return env_pb2.StepResponse(observation=s.observation, reward=s.reward, done=s.done, success=s.success,
                                    available_actions=s.available_actions, turn=s.turn, valid_action=s.valid)

    @ERRORS.wrap
    def Close(self, request, context):
        self.manager.close(bounded("session_id", request.session_id))
        return env_pb2.CloseResponse()

    @ERRORS.wrap
    def ExpertAction(self, request, context):
        action = self.manager.expert_action(bounded("session_id", request.session_id))
        return env_pb2.ExpertActionResponse(action=action)
