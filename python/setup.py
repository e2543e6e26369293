"""Installs the dbs Python package (a worker of a dbs job in PyTorch), offline, on Debian's
python3-grpcio, python3-protobuf and python3-torch:

    python3 -m venv --system-site-packages ENV && ENV/bin/pip install ./python

The gRPC stubs are generated from the checkout's proto/dbs.proto at build time with protoc
(protobuf-compiler) and grpc_python_plugin (protobuf-compiler-grpc).
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.path.join(HERE, os.pardir, "proto")


def generate_stubs(out_dir):
    """dbs/_proto/dbs_pb2.py and dbs_pb2_grpc.py under out_dir, from proto/dbs.proto."""
    plugin = shutil.which("grpc_python_plugin")
    if shutil.which("protoc") is None or plugin is None:
        raise SystemExit("dbs: protoc and grpc_python_plugin are needed to build the package: "
                         "sudo apt-get install protobuf-compiler protobuf-compiler-grpc")
    if not os.path.exists(os.path.join(PROTO_DIR, "dbs.proto")):
        raise SystemExit(f"dbs: {PROTO_DIR}/dbs.proto not found: install from a dbs checkout "
                         "(pip install ./python at its root)")
    target = os.path.join(out_dir, "dbs", "_proto")
    os.makedirs(target, exist_ok=True)
    open(os.path.join(target, "__init__.py"), "w").close()
    subprocess.run(["protoc", f"--proto_path=dbs/_proto={PROTO_DIR}", f"--python_out={out_dir}",
                    f"--grpc_out={out_dir}", f"--plugin=protoc-gen-grpc={plugin}",
                    "dbs/_proto/dbs.proto"], check=True)


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)


setup(
    name="dbs",
    version="1.0.0",
    description="Python workers for dbs, synchronous data-parallel training with Dynamic Batch "
                "Size",
    packages=["dbs"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildWithStubs},
)
