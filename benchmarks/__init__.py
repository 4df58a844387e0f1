"""The project's benchmarks (scripts; `benchmarks._fedsim` and the shaped-link harness are imported by tests).

A regular package, not a namespace one: a dependency that installs a top-level `benchmarks`
package of its own (opacus 1.6.0 does) would otherwise shadow this directory, since Python only
falls back to a namespace package when no regular package of that name is on the path.
"""
