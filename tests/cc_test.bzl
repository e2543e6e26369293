"""cc_test with the ThreadSanitizer shim for Debian's Abseil (tests/tsan) under --config=tsan."""

def cc_test(name, deps = [], **kwargs):
    native.cc_test(
        name = name,
        deps = deps + select({
            "//tests/tsan:on": ["//tests/tsan:absl_sync_annotations"],
            "//conditions:default": [],
        }),
        **kwargs
    )
