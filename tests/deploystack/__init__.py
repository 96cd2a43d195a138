"""The harness of `make test-deploy`: the Compose stack built and run for real on this machine's
container engine (tests/test_deploy_stack.py). Nothing here is imported by the default suite."""
