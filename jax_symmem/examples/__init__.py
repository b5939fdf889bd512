"""Small example models used by the demo, the tests and the experiments."""
