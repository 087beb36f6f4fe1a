"""Environment throughput: steps per second through gRPC on loopback beside a direct call.

For every environment: play the expert on test tasks, once through the SessionManager directly
(in-process, no gRPC) and once through a real env server on loopback, and print steps/s side by
side; the ratio is the gRPC overhead. Expert-action calls are counted as steps' companions in both.

    .venv/bin/python bench/env_throughput.py [--envs maze,wordle] [--episodes 50]
"""

from __future__ import annotations

import argparse
import time

from fedse.transport.serving import insecure_channel
from fedse.v1 import env_pb2 as epb
from fedse.v1 import env_pb2_grpc as epb_grpc
from services.env_server.envs import KNOWN_ENVS
from services.env_server.registry import make_environment
from services.env_server.server import EnvServerConfig, create_server
from services.env_server.sessions import SessionManager


def direct(manager: SessionManager, env: str, task_ids: list[int]) -> tuple[int, float]:
    steps, start = 0, time.perf_counter()
    for task_id in task_ids:
        sid = manager.reset(env, task_id).session_id
        while True:
            out = manager.step(sid, manager.expert_action(sid))
            steps += 1
            if out.done:
                break
        manager.close(sid)
    return steps, time.perf_counter() - start


def over_grpc(stub, env: str, task_ids: list[int]) -> tuple[int, float]:
    steps, start = 0, time.perf_counter()
    for task_id in task_ids:
        sid = stub.Reset(epb.ResetRequest(env=env, task_id=task_id)).session_id
        while True:
            action = stub.ExpertAction(epb.ExpertActionRequest(session_id=sid)).action
            out = stub.Step(epb.StepRequest(session_id=sid, action=action))
            steps += 1
            if out.done:
                break
        stub.Close(epb.CloseRequest(session_id=sid))
    return steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", default=",".join(KNOWN_ENVS))
    parser.add_argument("--episodes", type=int, default=50)
    args = parser.parse_args()
    envs = [e for e in args.envs.split(",") if e]
    server, port = create_server(EnvServerConfig(address="127.0.0.1:0", envs=",".join(envs), metrics_port=-1))
    server.start()
    manager = SessionManager({e: make_environment(e) for e in envs})
    print(f"{'env':<10} {'episodes':>8} {'steps':>6} {'direct steps/s':>15} {'gRPC steps/s':>13} {'overhead x':>10}"
          f" {'gRPC ms/step':>12}")
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = epb_grpc.EnvServiceStub(channel)
        for env in envs:
            test_ids = manager.list_tasks(env, "test")[0]
            ids = (test_ids * (args.episodes // len(test_ids) + 1))[: args.episodes]
            over_grpc(stub, env, ids[:2])  # warm-up: channel, caches
            n_direct, t_direct = direct(manager, env, ids)
            n_grpc, t_grpc = over_grpc(stub, env, ids)
            d, g = n_direct / t_direct, n_grpc / t_grpc
            print(f"{env:<10} {len(ids):>8} {n_grpc:>6} {d:>15.0f} {g:>13.0f} {d / g:>10.1f} {1000 / g:>12.2f}",
                  flush=True)
    server.stop(0)


if __name__ == "__main__":
    main()
