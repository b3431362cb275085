"""Generated gRPC stubs for `proto/pdserve.proto` (regenerate with scripts/gen_proto.sh; do not edit).

`pdserve_pb2` holds the messages, `pdserve_pb2_grpc` the `GenerationStub` client and the
`add_GenerationServicer_to_server` function that Serve's gRPC proxy registers
(see `deployments.frontend.grpc_app.grpc_options`).
"""
