"""The hot path's own JSON and IP codecs must agree with the standard library exactly."""

from __future__ import annotations

import ipaddress
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from rdma_netns.kernel.inet import Prefix
from rdma_netns.util import jsonio

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=25,
)


@given(json_values)
def test_jsonio_round_trips_like_json(value):
    text = jsonio.dumps(value)
    assert json.loads(text) == value
    assert jsonio.loads(text) == value
    assert jsonio.loads(text.encode()) == value


@given(st.text(max_size=60))
@settings(max_examples=examples(400))
def test_jsonio_accepts_and_rejects_what_json_does(text):
    try:
        expected = json.loads(text)
    except ValueError:
        with pytest.raises(ValueError):
            jsonio.loads(text)
        return
    assert json.dumps(jsonio.loads(text)) == json.dumps(expected)  # NaN never equals itself, in a list too


@pytest.mark.parametrize("text", ["NaN", "[NaN]", '{"a": [NaN, -Infinity]}', "-0", "1e400", '"\\u2028"'])
def test_jsonio_reads_nan_infinity_and_edge_numbers_as_json_does(text):
    assert json.dumps(jsonio.loads(text)) == json.dumps(json.loads(text))


@given(st.ip_addresses(v=6), st.integers(0, 128))
def test_prefix_matches_ipaddress_v6(addr, plen):
    text = f"{addr}/{plen}"
    ours = Prefix.parse(text)
    ref = ipaddress.ip_interface(text)
    assert ipaddress.ip_interface(str(ours)) == ref
    assert ipaddress.ip_network(str(ours.network)) == ref.network
    if ref.ip.ipv4_mapped is None:  # inet_ntop writes mapped addresses dotted; both forms are valid
        assert str(ours) == str(ref) and ours.address_text() == str(ref.ip)
    assert ours.exploded() == ref.ip.exploded


@given(st.ip_addresses(v=4), st.integers(0, 32))
def test_prefix_matches_ipaddress_v4(addr, plen):
    text = f"{addr}/{plen}"
    assert str(Prefix.parse(text)) == str(ipaddress.ip_interface(text))
    assert str(Prefix.parse(text).network) == str(ipaddress.ip_interface(text).network)


@pytest.mark.parametrize("bad", ["", "fd00::/129", "10.0.0.1/33", "fd00::1/-1", "nonsense", "1.2.3/8", None, 5])
def test_prefix_rejects_garbage(bad):
    with pytest.raises(ValueError):
        Prefix.parse(bad)
