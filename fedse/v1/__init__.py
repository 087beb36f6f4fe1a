"""Generated protobuf and gRPC code for the fedse.v1 protocol (`make proto`); do not edit."""
