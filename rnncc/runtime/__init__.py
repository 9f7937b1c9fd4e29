"""Runtime: loading and calling compiled modules. Needs only TVM's runtime library."""
