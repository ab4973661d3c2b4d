"""Continuous-integration logic for Furlong's GitHub workflows (`.github/workflows/`).

The workflows stay thin: every decision they need (the `/rerun-test` command grammar, who may run
it, the status-comment outcome, the dependency directives, the Megatron platform-patch probe, the
install-baseline check) is a pure function here, tested without GitHub. `python -m tools.ci COMMAND`
is the edge that reads the environment a workflow step provides and talks to the GitHub REST API.

Everything a runner imports from this package uses the standard library only, so a bare runner
Python can run it before anything is installed. See docs/ci.md.
"""
