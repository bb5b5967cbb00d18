"""Generated gRPC stubs of the fedatoms.v1 wire contract: made from proto/ by `make proto`; do not edit."""
