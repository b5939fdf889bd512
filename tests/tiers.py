"""Hypothesis properties that run a few examples in the fast tier and more in the slow one."""


def own_database_key(test, max_examples):
  """Keys `test`'s example database (and its derandomized examples) on `max_examples` too.

  Hypothesis keys its example database on the test's source (plus this attribute):
  without it the fast and slow runs of a property replay each other's failures.
  """
  inner = test.hypothesis.inner_test
  inner._hypothesis_internal_add_digest = f"max_examples={max_examples}".encode()
