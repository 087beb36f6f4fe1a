"""EnvService over a SessionManager: protobuf in and out, domain errors mapped to status codes."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import grpc

from fedse.inputs import InputError, bounded, status_message
from fedse.v1 import env_pb2, env_pb2_grpc

from .sessions import (
    BadAction,
    BadSplit,
    EnvServerError,
    EpisodeDone,
    SessionManager,
    TooManySessions,
    UnknownEnvironment,
    UnknownSession,
    UnknownTaskId,
)

SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name

STATUS_OF: dict[type[EnvServerError], grpc.StatusCode] = {
    UnknownSession: grpc.StatusCode.NOT_FOUND,
    UnknownEnvironment: grpc.StatusCode.NOT_FOUND,
    UnknownTaskId: grpc.StatusCode.NOT_FOUND,
    TooManySessions: grpc.StatusCode.RESOURCE_EXHAUSTED,
    BadSplit: grpc.StatusCode.INVALID_ARGUMENT,
    BadAction: grpc.StatusCode.INVALID_ARGUMENT,
    EpisodeDone: grpc.StatusCode.FAILED_PRECONDITION,
}

R = TypeVar("R")


def _status(exc: EnvServerError) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return grpc.StatusCode.INTERNAL


def _maps_errors(method: Callable[..., R]) -> Callable[..., R]:
    @functools.wraps(method)
    def wrapped(self, request, context: grpc.ServicerContext) -> R:
        try:
            return method(self, request, context)
        except EnvServerError as exc:
            context.abort(_status(exc), status_message(str(exc)))
            raise  # unreachable: abort raises
        except InputError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_message(str(exc)))
            raise
    return wrapped


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, manager: SessionManager):
        self.manager = manager

    @_maps_errors
    def ListEnvironments(self, request, context):
        return env_pb2.ListEnvironmentsResponse(envs=self.manager.env_names())

    @_maps_errors
    def ListTasks(self, request, context):
        task_ids, max_turns = self.manager.list_tasks(bounded("env", request.env), bounded("split", request.split))
        return env_pb2.ListTasksResponse(env=request.env, split=request.split, task_ids=task_ids,
                                         max_turns=max_turns)

    @_maps_errors
    def Reset(self, request, context):
        r = self.manager.reset(bounded("env", request.env), request.task_id)
        return env_pb2.ResetResponse(session_id=r.session_id, instruction=r.instruction, observation=r.observation,
                                     available_actions=r.available_actions, max_turns=r.max_turns)

    @_maps_errors
    def Step(self, request, context):
        s = self.manager.step(bounded("session_id", request.session_id), request.action)
        return env_pb2.StepResponse(observation=s.observation, reward=s.reward, done=s.done, success=s.success,
                                    available_actions=s.available_actions, turn=s.turn, valid_action=s.valid)

    @_maps_errors
    def Close(self, request, context):
        self.manager.close(bounded("session_id", request.session_id))
        return env_pb2.CloseResponse()

    @_maps_errors
    def ExpertAction(self, request, context):
        action = self.manager.expert_action(bounded("session_id", request.session_id))
        return env_pb2.ExpertActionResponse(action=action)
