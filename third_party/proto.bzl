"""cc_grpc_library: protoc + grpc_cpp_plugin from Debian, run in a genrule.

Bazel's native proto rules need @com_google_protobuf (a download); the system protoc does the same
job offline.
"""

def cc_grpc_library(name, src, imports = [], deps = [], **kwargs):
    """`imports`: the .proto files `src` imports (their cc library goes in `deps`)."""
    base = src[:-len(".proto")]
    outs = [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_gen",
        srcs = [src] + imports,
        outs = outs,
        cmd = " ".join([
            "protoc",
            "--proto_path=.",
            "--cpp_out=$(GENDIR)",
            "--grpc_out=$(GENDIR)",
            "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin",
            "$(location %s)" % src,
        ]),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["@system//:grpc"],
        **kwargs
    )
