"""Repository rule exposing Debian's system libraries (and a libtorch) as cc_library targets.

Nothing is downloaded: the rule only looks at the local file system. Abseil ships as ~60 shared
libraries; the rule lists whatever libabsl_*.so files exist so link lines never go stale.
LIBTORCH_DIR (environment, read at build time) points at another libtorch, for example the official
CUDA archive or the `torch` Python package's directory; unset, Debian's CPU libtorch in /usr is used.
"""

_LIBDIR = "/usr/lib/x86_64-linux-gnu"

def _linkopts(libs):
    return ", ".join(['"-l%s"' % l for l in libs])

def _system_libs_impl(ctx):
    absl = []
    for f in ctx.path(_LIBDIR).readdir():
        name = f.basename
        if name.startswith("libabsl_") and name.endswith(".so"):
            absl.append(name[3:-3])
    absl = sorted(absl)
    if not absl:
        fail("Abseil is missing: run deploy/install_deps.sh (apt-get install libabsl-dev)")

    if not ctx.path(_LIBDIR + "/libtcmalloc_minimal.so").exists:
        fail("tcmalloc is missing: run deploy/install_deps.sh (apt-get install libgoogle-perftools-dev)")

    torch_dir = ctx.os.environ.get("LIBTORCH_DIR", "")
    torch_libs = ["torch", "torch_cpu", "c10"]
    torch_linkopts = []
    if torch_dir:
        ctx.symlink(torch_dir + "/include", "libtorch/include")
        ctx.symlink(torch_dir + "/include/torch/csrc/api/include", "libtorch/api")
        torch_includes = '["libtorch/include", "libtorch/api"]'
        libdir = torch_dir + "/lib"
        if ctx.path(libdir + "/libtorch_cuda.so").exists:
            torch_libs = ["torch", "torch_cuda", "torch_cpu", "c10_cuda", "c10"]
        torch_linkopts = ['"-L%s"' % libdir, '"-Wl,-rpath,%s"' % libdir, '"-Wl,--no-as-needed"']
    else:
        ctx.symlink("/usr/include/torch/csrc/api/include", "libtorch/api")
        torch_includes = '["libtorch/api"]'
    torch_linkopts = ", ".join(torch_linkopts + ['"-l%s"' % l for l in torch_libs])

    ctx.file("WORKSPACE", 'workspace(name = "%s")\n' % ctx.name)
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "absl",
    linkopts = [{absl}],
)

cc_library(
    name = "protobuf",
    linkopts = ["-lprotobuf", "-pthread"],
)

cc_library(
    name = "grpc",
    linkopts = ["-lgrpc++", "-lgrpc", "-lgpr"],
    deps = [":protobuf", ":absl"],
)

cc_library(
    name = "glog",
    linkopts = ["-lglog", "-lgflags"],
)

# OpenSSL's libcrypto (libssl-dev): HMAC-SHA256 for worker tokens.
cc_library(
    name = "openssl",
    linkopts = ["-lcrypto"],
)

# gperftools' tcmalloc as the processes' malloc (see //common:malloc). --no-as-needed keeps it
# among the executable's own libraries although nothing calls it by name: placed before libc
# there, its malloc and free are the ones every library gets.
cc_library(
    name = "tcmalloc",
    linkopts = ["-Wl,--push-state,--no-as-needed", "-ltcmalloc_minimal", "-Wl,--pop-state"],
)

cc_library(
    name = "zlib",
    linkopts = ["-lz"],
)

cc_library(
    name = "gtest",
    linkopts = ["-lgmock", "-lgtest", "-pthread"],
)

cc_library(
    name = "gtest_main",
    linkopts = ["-lgmock_main"],
    deps = [":gtest"],
)

cc_library(
    name = "json",
)

# prometheus-cpp's metric types and text format (prometheus-cpp-dev).
cc_library(
    name = "prometheus",
    linkopts = ["-lprometheus-cpp-core"],
)

# cpp-httplib (libcpp-httplib-dev), built by Debian with these options: the header must see the
# same ones.
cc_library(
    name = "httplib",
    defines = [
        "CPPHTTPLIB_OPENSSL_SUPPORT",
        "CPPHTTPLIB_ZLIB_SUPPORT",
        "CPPHTTPLIB_BROTLI_SUPPORT",
    ],
    linkopts = ["-lcpp-httplib", "-pthread"],
)

cc_library(
    name = "torch",
    hdrs = glob(["libtorch/**/*.h"]),
    includes = {torch_includes},
    linkopts = [{torch_linkopts}],
)
""".format(absl = _linkopts(absl), torch_includes = torch_includes, torch_linkopts = torch_linkopts))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    environ = ["LIBTORCH_DIR"],
    local = True,
)
