"""process_test: a Python test that starts real dbs_ps/dbs_worker processes, built on
tests/cluster_test.py's ProcessTestCase (loopback ports picked at run time, every process
stopped in tearDown). Runs alone: timing-sensitive on two cores."""

def process_test(name, data = []):
    native.py_test(
        name = name,
        size = "large",
        srcs = ["cluster_test.py", name + ".py"],
        data = data + ["//deploy:launcher", "//server:dbs_ps", "//worker:dbs_worker"],
        main = name + ".py",
        python_version = "PY3",
        tags = ["exclusive"],
        # The allocator the binaries were linked with (//common:malloc), for the test that
        # checks what the running processes really use.
        env = select({
            "//common:system_malloc": {"EXPECTED_MALLOC": "system"},
            "//conditions:default": {"EXPECTED_MALLOC": "tcmalloc"},
        }),
    )
