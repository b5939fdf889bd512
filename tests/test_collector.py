"""The planner's stages pause the cyclic garbage collector and leave it as they found it."""

import gc

import pytest

from jax_symmem._src import collector
from jax_symmem._src import schedule
from tests.test_schedule import _traced
from tests.programs import CASES


def test_paused_restores_the_collector_also_on_error():
  assert gc.isenabled()
  with pytest.raises(ZeroDivisionError):
    with collector.paused():
      assert not gc.isenabled()
      with collector.paused():   # nested: the outer block enables it again
        pass
      assert not gc.isenabled()
      1 / 0
  assert gc.isenabled()


def test_a_caller_who_disabled_the_collector_keeps_it_disabled():
  _, graph = _traced(CASES[0].name)
  gc.disable()
  try:
    schedule.schedule(graph)
    assert not gc.isenabled()
  finally:
    gc.enable()
  schedule.schedule(graph)
  assert gc.isenabled()
