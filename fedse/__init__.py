"""fedse: federated self-evolution of LLM agents over gRPC (shared code of all services)."""
