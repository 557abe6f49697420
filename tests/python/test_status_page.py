#!/usr/bin/python3
"""The status page of a running job, in a real browser and through
Prometheus's own parser.

    test_status_page.py LIMBO [--screenshot PATH]

1. An elastic job of 3 workers serves its page (limbo launch's default).
   Headless Chromium loads it (--dump-dom after a virtual-time budget): the
   charts rendered, with points, and the page shows 3 members and each
   one's share of the batch (elastic.shares = "pace").
2. One worker is SIGKILLed; the page then shows 2 members and a crash event.
3. /metrics parses with prometheus_client's parser: limbo_members (gauge),
   limbo_samples_total (counter); a parameter-server job adds the
   limbo_staleness histogram.
A screenshot of the page is written to --screenshot (default: next to the
run directory). Exit code 77 (skipped) only when Chromium cannot start.
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
JOB = ["--set", "model.name=lenet", "--set", "data.train_limit=20000", "--set", "data.test_limit=500",
       "--set", "train.epochs=60", "--set", "train.progress=false", "--set", "train.log_every=10",
       "--set", "optim.clip_grad_norm=5",  # clipping on: the gradient-norm chart is drawn too
       "--set", "elastic.shares=pace"]  # shares of the batch by pace: each member's share and pace listed


def chromium(args, timeout=60):
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--user-data-dir=" + tempfile.mkdtemp(prefix="limbo-chromium-")]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=timeout)


def dump(url):
    out = chromium(["--virtual-time-budget=5000", "--dump-dom", url]).stdout
    m = re.search(r"<body([^>]*)>", out)
    if not m:
        raise AssertionError("no <body> in the page Chromium rendered:\n" + out[:2000])
    attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', m.group(1)))
    attrs["canvases"] = len(re.findall(r"<canvas", out))
    return attrs, out


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def wait_until(what, pred, timeout):
    end = time.time() + timeout
    while time.time() < end:
        try:
            v = pred()
            if v:
                return v
        except (OSError, ValueError, TypeError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError("timed out waiting for " + what)


def stop(proc, log):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def check_prometheus(text, want):
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in want.items():
        assert name in fams, f"{name} missing from /metrics:\n{text}"
        assert fams[name].type == kind, f"{name} is a {fams[name].type}, expected {kind}"
    return fams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("limbo")
    ap.add_argument("--screenshot", default="")
    a = ap.parse_args()
    if not CHROMIUM:
        print("skipped: chromium is not installed (Debian package `chromium`)")
        return 77
    try:
        probe = chromium(["--dump-dom", "about:blank"], timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"skipped: chromium cannot start here ({e})")
        return 77
    if "<body" not in probe.stdout:
        print("skipped: chromium cannot start here:\n" + probe.stderr[-2000:])
        return 77

    tmp = tempfile.mkdtemp(prefix="limbo-status-")
    run = os.path.join(tmp, "run")
    log = open(os.path.join(tmp, "launch.log"), "w")
    job = subprocess.Popen([a.limbo, "launch", "--nproc", "3", "--min-workers", "1", "--",
                            "--run-dir", run] + JOB, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = wait_until("status.url", lambda: open(os.path.join(run, "status.url")).read().strip(), 120)
        print("page:", url)
        wait_until("3 members, a few points and the members' shares",
                   lambda: (lambda s: s["members"] == 3 and len(s["series"]["t"]) >= 3 and s["shares"]
                            and len(s["shares"]) == 3)(json.loads(get(url + "status.json"))), 120)
        attrs, html = dump(url)
        print("browser, before:", {k: attrs[k] for k in ("updates", "charts", "members", "points", "canvases")})
        assert int(attrs["updates"]) >= 1, "the page never drew its data"
        assert int(attrs["charts"]) >= 6, f"only {attrs['charts']} charts rendered (with the gradient norm's)"
        assert int(attrs["points"]) >= 3, "the charts have no points"
        assert attrs["members"] == "3", f"the page shows {attrs['members']} members, expected 3"
        assert "shares of the batch by pace" in html and "rank 2: " in html and 'id="pace" class="hidden"' not in html, \
            re.search(r'<div id="pace".{0,300}', html)

        text = open(log.name).read()
        victim = int(re.search(r"worker rank 1 pid (\d+)", text).group(1))
        os.kill(victim, signal.SIGKILL)
        wait_until("2 members after the kill",
                   lambda: json.loads(get(url + "status.json"))["members"] == 2, 60)
        attrs, html = dump(url)
        print("browser, after the kill:", {k: attrs[k] for k in ("members", "events")})
        assert attrs["members"] == "2", f"the page shows {attrs['members']} members after the kill, expected 2"
        assert "crash" in attrs["events"], f"no crash event on the page: {attrs['events']}"
        time.sleep(3)  # a few points after the crash for the picture
        shot = a.screenshot or os.path.join(tmp, "status.png")
        chromium(["--virtual-time-budget=5000", "--window-size=1280,1100", "--hide-scrollbars",
                  "--screenshot=" + os.path.abspath(shot), url])
        assert os.path.getsize(shot) > 10000, "the screenshot is empty"
        print("screenshot:", shot)

        fams = check_prometheus(get(url + "metrics"), {"limbo_members": "gauge", "limbo_samples": "counter"})
        members = [s.value for s in fams["limbo_members"].samples]
        assert members == [2.0], f"limbo_members = {members}"
        print("prometheus_client parsed", len(fams), "families from the elastic job")
    finally:
        stop(job, log)

    # A parameter-server job: the staleness histogram.
    prun = os.path.join(tmp, "ps")
    plog = open(os.path.join(tmp, "ps.log"), "w")
    ps = subprocess.Popen([a.limbo, "launch", "--mode", "async", "--servers", "2", "--workers", "3",
                           "--run-dir", prun, "--", "--set", "model.name=mlp", "--set", "train.epochs=30",
                           "--set", "data.train_limit=6000", "--set", "data.test_limit=300",
                           "--set", "ps.log_every=20", "--set", "train.log_every=10",
                           "--set", "train.progress=false"], stdout=plog, stderr=subprocess.STDOUT)
    try:
        url = wait_until("status.url", lambda: open(os.path.join(prun, "status.url")).read().strip(), 120)
        wait_until("staleness counts",
                   lambda: json.loads(get(url + "status.json"))["ps"]["staleness_hist"], 120)
        fams = check_prometheus(get(url + "metrics"), {"limbo_members": "gauge", "limbo_samples": "counter",
                                                       "limbo_staleness": "histogram"})
        buckets = [s for s in fams["limbo_staleness"].samples if s.name == "limbo_staleness_bucket"]
        count = [s.value for s in fams["limbo_staleness"].samples if s.name == "limbo_staleness_count"][0]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count > 0, buckets
        attrs, _ = dump(url)
        assert int(attrs["charts"]) >= 8, f"parameter-server charts missing: {attrs}"
        print("parameter-server job: histogram of", int(count), "gradients;", attrs["charts"], "charts")
    finally:
        stop(ps, plog)
    shutil.rmtree(tmp, ignore_errors=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
