"""The launcher's cheap stand-in for torch elastic's rendezvous `get_method_name` names the same
function as elastic's own (which reads every frame's source through inspect.stack)."""

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from autotuner.launch import elastic

ELASTICS_OWN = dynamic_rendezvous.get_method_name


def _record(name_of):  # stands where elastic's _record stands: one frame below the named method
    return name_of()


def a_rendezvous_method(name_of):
    return _record(name_of)


def test_the_frame_name_is_elastics_name_at_every_depth():
    assert a_rendezvous_method(elastic._frame_method_name) == a_rendezvous_method(ELASTICS_OWN) \
        == "a_rendezvous_method"
    for depth in (0, 1, 3):
        assert elastic._frame_method_name(depth + 1) == ELASTICS_OWN(depth + 1)
    assert elastic._frame_method_name(10_000) == ELASTICS_OWN(10_000) == "no_method_name"


def test_the_launcher_puts_it_in_place_of_elastics(monkeypatch):
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", ELASTICS_OWN)
    elastic._cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is elastic._frame_method_name
