"""The emulators answer as the clouds document (so a watcher passing against them means something)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.emulators import AwsImdsEmulator, AzureEventsEmulator, GcpMetadataEmulator
from trainguard.agent.watchers.http import HttpClient, MetadataError

pytestmark = pytest.mark.timeout(20)

http = HttpClient(3.0)


def test_aws_imdsv2_to_the_letter():
    with AwsImdsEmulator() as aws:
        u = aws.url
        assert http.request("GET", u + "/latest/meta-data/spot/instance-action").status == 401  # no token
        for ttl in (None, "0", "21601", "abc", "-5"):
            hdr = {} if ttl is None else {"X-aws-ec2-metadata-token-ttl-seconds": ttl}
            assert http.request("PUT", u + "/latest/api/token", hdr).status == 400
        assert http.request("GET", u + "/latest/api/token").status == 405
        assert http.request("PUT", u + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "5",
                                                              "X-Forwarded-For": "1.2.3.4"}).status == 403
        r = http.request("PUT", u + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "1"})
        assert r.status == 200 and r.header("X-aws-ec2-metadata-token-ttl-seconds") == "1"
        tok = {"X-aws-ec2-metadata-token": r.text()}
        ia = http.request("GET", u + "/latest/meta-data/spot/instance-action", tok)
        assert ia.status == 404 and b"404 - Not Found" in ia.body
        assert http.request("GET", u + "/latest/meta-data/spot/instance-action",
                            {"X-aws-ec2-metadata-token": "forged"}).status == 401
        t = aws.schedule_termination(in_s=120, action="stop")
        ia = http.request("GET", u + "/latest/meta-data/spot/instance-action", tok)
        assert ia.status == 200 and json.loads(ia.body) == {"action": "stop", "time": t}
        time.sleep(1.1)  # token TTL passed
        assert http.request("GET", u + "/latest/meta-data/spot/instance-action", tok).status == 401
        assert aws.server_header == "EC2ws"


def test_gcp_metadata_to_the_letter():
    with GcpMetadataEmulator() as gcp:
        url = gcp.url + "/computeMetadata/v1/instance/preempted"
        assert http.request("GET", url).status == 403
        assert http.request("GET", url, {"Metadata-Flavor": "Google", "X-Forwarded-For": "x"}).status == 403
        r = http.request("GET", url, {"Metadata-Flavor": "Google"})
        assert (r.status, r.body, r.header("Metadata-Flavor")) == (200, b"FALSE", "Google")
        etag = r.header("ETag")
        assert http.request("GET", url + "?wait_for_change=true&timeout_sec=0",
                            {"Metadata-Flavor": "Google"}).status == 400
        # unchanged value: held for timeout_sec, then the same value/etag
        t0 = time.monotonic()
        r2 = http.request("GET", url + f"?wait_for_change=true&timeout_sec=1&last_etag={etag}",
                          {"Metadata-Flavor": "Google"})
        assert 0.9 <= time.monotonic() - t0 < 2.5 and r2.header("ETag") == etag and r2.body == b"FALSE"
        # stale last_etag: answered at once
        t0 = time.monotonic()
        http.request("GET", url + "?wait_for_change=true&timeout_sec=5&last_etag=stale", {"Metadata-Flavor": "Google"})
        assert time.monotonic() - t0 < 0.5
        # a change wakes a waiting request
        threading.Timer(0.3, gcp.preempt).start()
        r3 = http.request("GET", url + f"?wait_for_change=true&timeout_sec=5&last_etag={etag}",
                          {"Metadata-Flavor": "Google"})
        assert r3.body == b"TRUE" and r3.header("ETag") != etag
        assert http.request("GET", gcp.url + "/computeMetadata/v1/instance/nope", {"Metadata-Flavor": "Google"}
                            ).status == 404


def test_azure_scheduled_events_to_the_letter():
    with AzureEventsEmulator(vm_name="vm-a") as az:
        url = az.url + "/metadata/scheduledevents"
        r = http.request("GET", url + "?api-version=2020-07-01")
        assert r.status == 400 and "metadata header" in json.loads(r.body)["error"]
        r = http.request("GET", url, {"Metadata": "true"})
        assert r.status == 400 and "api-version" in json.loads(r.body)["error"]
        r = http.request("GET", url + "?api-version=1999-01-01", {"Metadata": "true"})
        assert r.status == 400 and "newest-versions" in json.loads(r.body)
        doc = json.loads(http.request("GET", url + "?api-version=2020-07-01", {"Metadata": "true"}).body)
        assert doc == {"DocumentIncarnation": 1, "Events": []}
        eid = az.preempt(in_s=30)
        doc = json.loads(http.request("GET", url + "?api-version=2020-07-01", {"Metadata": "true"}).body)
        [ev] = doc["Events"]
        assert doc["DocumentIncarnation"] == 2
        assert set(ev) == {"EventId", "EventType", "ResourceType", "Resources", "EventStatus", "NotBefore",
                           "Description", "EventSource", "DurationInSeconds"}
        assert (ev["EventType"], ev["Resources"], ev["EventStatus"]) == ("Preempt", ["vm-a"], "Scheduled")
        assert ev["NotBefore"].endswith(" GMT")
        assert http.request("POST", url + "?api-version=2020-07-01", {"Metadata": "true"}, b"{bad").status == 400
        assert http.request("POST", url + "?api-version=2020-07-01", {"Metadata": "true"},
                            json.dumps({"StartRequests": [{"EventId": eid}]}).encode()).status == 200
        doc = json.loads(http.request("GET", url + "?api-version=2020-07-01", {"Metadata": "true"}).body)
        assert doc["DocumentIncarnation"] == 3 and doc["Events"][0]["EventStatus"] == "Started"
        name = http.request("GET", az.url + "/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                            {"Metadata": "true"})
        assert name.body == b"vm-a"


def test_misbehaviour_modes_and_request_log():
    with AwsImdsEmulator(require_token=False) as aws:
        u = aws.url + "/latest/meta-data/spot/instance-action"
        aws.misbehave("500")
        aws.misbehave("garbage")
        aws.misbehave("slow", delay_s=0.4)
        aws.misbehave("hang", delay_s=5)
        assert http.request("GET", u).status == 500
        g = http.request("GET", u)
        assert g.status == 200 and b"garbage" in g.body
        t0 = time.monotonic()
        assert http.request("GET", u).status == 404 and time.monotonic() - t0 >= 0.4
        with pytest.raises(MetadataError) as ei:
            HttpClient(0.3).request("GET", u)
        assert ei.value.status is None and "0.3s" in ei.value.message
        assert http.request("GET", u).status == 404  # count exhausted: back to normal
        assert [r.misbehaviour for r in aws.requests] == ["500", "garbage", "slow", "hang", None]
        with pytest.raises(ValueError):
            aws.misbehave("explode")
    # close() released the hanging handler (the autouse leak check would fail otherwise)
