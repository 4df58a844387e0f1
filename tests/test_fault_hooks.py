"""The ClientApp's test-only `absent-rounds` hook (federation/site/fault_hooks.py): off unless set."""

from federation.site.fault_hooks import absent


def test_absent_rounds_names_the_rounds_a_site_sits_out_and_nothing_else():
    cfg = {"absent-rounds": "3, 7"}
    assert absent(cfg, 3) and "absent from round 3" in absent(cfg, 3)
    assert absent(cfg, 7) is not None
    assert absent(cfg, 4) is None
    assert absent({}, 3) is None and absent({"absent-rounds": ""}, 1) is None
