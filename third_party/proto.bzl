"""dbs_proto_library: protoc + grpc_cpp_plugin from Debian, run in a genrule.

Bazel's native proto rules need @com_google_protobuf (a download); the system protoc does the same
job offline.
"""

# Who may depend on the services' stubs: the server and worker packages (where layering_test keeps
# them to the adapters, the clients and the composition root) and the tests; not common/, bench/.
STUB_VISIBILITY = [
    "//server:__pkg__",
    "//tests:__subpackages__",
    "//worker:__pkg__",
]

def dbs_proto_library(name, src, imports = [], proto_deps = [], services = False):
    """Two cc libraries for `src`: `<name>_cc_proto` (its messages, protobuf only) and, when the
    file declares services, `<name>_cc_grpc` (their stubs, on gRPC). Domain code depends on the
    first only, so gRPC stays in the adapters. `imports`: the .proto files `src` imports, whose
    `_cc_proto` libraries go in `proto_deps`."""
    base = src[:-len(".proto")]
    messages = [base + ".pb.h", base + ".pb.cc"]
    stubs = [base + ".grpc.pb.h", base + ".grpc.pb.cc"] if services else []
    cmd = ["protoc", "--proto_path=.", "--cpp_out=$(GENDIR)"]
    if services:
        cmd += ["--grpc_out=$(GENDIR)", "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin"]
    native.genrule(
        name = name + "_gen",
        srcs = [src] + imports,
        outs = messages + stubs,
        cmd = " ".join(cmd + ["$(location %s)" % src]),
    )
    native.cc_library(
        name = name + "_cc_proto",
        srcs = [messages[1]],
        hdrs = [messages[0]],
        deps = proto_deps + ["@system//:protobuf"],
    )
    if services:
        native.cc_library(
            name = name + "_cc_grpc",
            srcs = [stubs[1]],
            hdrs = [stubs[0]],
            deps = [":" + name + "_cc_proto", "@system//:grpc"],
            visibility = STUB_VISIBILITY,
        )
