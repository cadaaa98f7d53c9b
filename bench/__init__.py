"""The measurement harness behind `rgpu bench` and the pytest-benchmark suites."""
