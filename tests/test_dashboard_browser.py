"""The dashboard in real headless Chromium (Debian's chromium + chromedriver, driven by selenium)
against the live embedded server after a real job: sign in with the key, the jobs list shows
the finished job, its charts draw the points the API holds (read back from the page and from
the canvas pixels), events, checkpoints, the adapter and the results file downloads (sha256 checked in the page).
Screenshots go to test-artifacts/. Skips when chromium, chromedriver or selenium is missing."""
from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests._client_server import JOB_SPEC_YAML, STEPS, CliJob, Served, cli_job, qerl_server  # noqa: F401

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
SERIES_RGB = [(0x2F, 0x6F, 0xDE), (0xE8, 0x59, 0x0C)]  # train and eval strokes in app.js

pytestmark = pytest.mark.timeout(900)
needs_chromium = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="qerl-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1500", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver, condition, timeout: float = 30.0, what: str = "the page"):  # type: ignore[no-untyped-def]
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: condition(d))
    except TimeoutException:
        logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
        pytest.fail(f"timed out waiting for {what}; browser console: {logs}")


def _open_job_page(driver, served: Served, job_id: str) -> None:  # type: ignore[no-untyped-def]
    """Signed in with the server's key (kept by the page in local storage), on the job's page."""
    driver.get(f"{served.url}/")
    driver.execute_script("localStorage.setItem('qerl.apiKey', arguments[0])", served.api_key)
    driver.get(f"{served.url}/#/jobs/{job_id}")
    driver.refresh()


def _ended_job(driver, served: Served, body: dict) -> dict:  # type: ignore[no-untyped-def]
    """The job ``body`` creates, once it has ended."""
    resp = httpx.post(f"{served.url}/v1/fine_tuning/jobs", json=body, headers=served.headers)
    assert resp.status_code == 200, resp.text

    def ended(_driver) -> dict | None:  # type: ignore[no-untyped-def]
        job = httpx.get(f"{served.url}/v1/fine_tuning/jobs/{resp.json()['id']}", headers=served.headers).json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    return _wait(driver, ended, timeout=300, what="the job to end")


def _series_pixels(driver, metric: str) -> int:  # type: ignore[no-untyped-def]
    """Canvas pixels of the chart painted in a series' colour (lines and points)."""
    return driver.execute_script("""
        const canvas = document.querySelector(`.chart[data-metric="${arguments[0]}"] canvas`);
        if (!canvas) return 0;
        const px = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let n = 0;
        for (let i = 0; i < px.length; i += 4)
          for (const [r, g, b] of arguments[1])
            if (Math.abs(px[i] - r) < 12 && Math.abs(px[i + 1] - g) < 12 && Math.abs(px[i + 2] - b) < 12 && px[i + 3] > 200) n++;
        return n;""", metric, [list(c) for c in SERIES_RGB])


@needs_chromium
def test_dashboard_shows_the_finished_job_with_its_curves(browser, cli_job: CliJob, qerl_server: Served) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = browser
    ARTIFACTS.mkdir(exist_ok=True)
    driver.get(f"{qerl_server.url}/")
    # sign in: a wrong key is refused with the server's message, the right one is kept
    box = _wait(driver, lambda d: d.find_elements(By.ID, "api-key"), what="the key form")[0]
    box.send_keys("sk-wrong")
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
    err = _wait(driver, lambda d: d.find_element(By.ID, "login-error").text, what="the login error")
    assert "key" in err.lower()
    box.clear()
    box.send_keys(qerl_server.api_key)
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()

    row_css = f'tr.job-row[data-job-id="{cli_job.job_id}"]'
    row = _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, row_css), what="the jobs list")[0]
    assert row.get_attribute("data-status") == "succeeded"
    assert f"{STEPS}/{STEPS}" in row.text and cli_job.job["fine_tuned_model"] in row.text
    assert driver.execute_script("return localStorage.getItem('qerl.apiKey')") == qerl_server.api_key
    driver.save_screenshot(str(ARTIFACTS / "dashboard-jobs.png"))

    row.find_element(By.TAG_NAME, "a").click()
    _wait(driver, lambda d: d.execute_script("return document.getElementById('main').dataset.streamEnded"),
          what="the job page to load and its event stream to end")

    metrics = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/metrics",
                        headers=qerl_server.headers).json()["data"]

    def expected(*keys: str) -> int:
        return sum(1 for m in metrics for k in keys
                   if isinstance(m["values"].get(k), (int, float)) and math.isfinite(m["values"][k]))

    want = {"reward": expected("reward_mean", "eval/reward_mean"), "accuracy": expected("accuracy", "eval/accuracy"),
            "entropy": expected("entropy"), "kl": expected("kl"), "aqn_sigma": expected("aqn_sigma"),
            "tokens_per_s": expected("rollout_tokens_per_s")}
    assert want["reward"] == 2 * STEPS and all(n >= STEPS for n in want.values()), want  # eval at 0 and at the end
    got = _wait(driver, lambda d: (lambda g: g if g == want else None)(d.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('.chart')]"
        ".map(c => [c.dataset.metric, +c.dataset.points]))")), what=f"charts with {want} points")
    assert got == want
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(ARTIFACTS / "dashboard-job.png"))
    for metric in want:
        assert _series_pixels(driver, metric) > 20, f"the {metric} chart has no painted series"

    # the job's settings read as `qerl jobs get` prints them (the same spec, the same numbers)
    from qerl.compare import settings

    panel = driver.execute_script("return [...document.querySelectorAll('#job-settings > div')]"
                                  ".map(d => [d.querySelector('dt').textContent, d.querySelector('dd').textContent])")
    want = settings(cli_job.job["qerl"]["spec"])
    assert [(k.lower(), v) for k, v in panel] == [(k.lower(), v) for k, v in want], panel
    assert "LoRA" in driver.find_element(By.ID, "job-settings").text  # shown, not folded away

    events = driver.find_elements(By.CSS_SELECTOR, "#events li")
    assert any(f"Step {STEPS}/{STEPS}" in e.text for e in events)
    assert any("successfully completed" in e.text for e in events)
    checkpoints = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/checkpoints",
                            headers=qerl_server.headers).json()["data"]
    rows = driver.find_elements(By.CSS_SELECTOR, "#checkpoints tbody tr")
    assert len(rows) == len(checkpoints) == STEPS
    assert driver.find_element(By.ID, "job-status").text == "succeeded"

    # a kept checkpoint's LoRA downloads (sha256 checked in the page)
    for step, expected in ((STEPS, "sha256 verified"), (STEPS - 1, "sha256 verified")):
        driver.find_element(By.CSS_SELECTOR, f'#checkpoints tr[data-step="{step}"] button.ckpt-download').click()
        got = _wait(driver, lambda d: (lambda t: t if t not in ("", "downloading…") else None)(
            d.find_element(By.CSS_SELECTOR, f'#checkpoints tr[data-step="{step}"] span').text),
            what=f"the checkpoint {step} download")
        assert expected in got, got

    adapter_id = cli_job.job["qerl"]["adapter_id"]
    adapter = driver.find_element(By.ID, "adapter")
    assert adapter_id in adapter.text and f"qerl adapters download {adapter_id}" in adapter.text
    driver.find_element(By.ID, "adapter-download").click()
    status = _wait(driver, lambda d: (lambda t: t if t not in ("", "downloading…") else None)(
        d.find_element(By.CSS_SELECTOR, "#adapter .ok, #adapter .error").text), what="the adapter download")
    assert status == "sha256 verified"
    # the newest step's samples, as the API lists them
    samples = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/samples",
                        headers=qerl_server.headers).json()["data"]
    shown = driver.find_elements(By.CSS_SELECTOR, "#samples tbody tr")
    assert samples and len(shown) == len(samples)
    for row, x in zip(shown, samples):
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        assert cells[:3] == [str(x["step"]), x["kind"], str(x["index"])] and cells[4].split() == x["completion"].split()
    assert driver.find_element(By.ID, "samples-step").text.lower() == f"step {samples[0]['step']}"
    pick = driver.find_element(By.ID, "samples-pick")  # another step's, by number
    pick.send_keys("1", Keys.ENTER)
    first = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{cli_job.job_id}/samples", params={"step": 1},
                      headers=qerl_server.headers).json()["data"]
    _wait(driver, lambda d: d.find_element(By.ID, "samples-step").text.lower() == "step 1" or None,
          what="step 1's samples")
    shown = driver.find_elements(By.CSS_SELECTOR, "#samples tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[4].text.split() for r in shown] == [x["completion"].split() for x in first]
    # and its results file, every step's metrics as CSV
    driver.find_element(By.ID, "results-download").click()
    status = _wait(driver, lambda d: (lambda t: t if t not in ("", "downloading…") else None)(
        d.find_element(By.ID, "results-status").text), what="the results file download")
    assert status == "sha256 verified"
    assert (ARTIFACTS / "dashboard-job.png").stat().st_size > 10_000


def test_dashboard_serves_only_its_own_files(qerl_server: Served) -> None:
    page = httpx.get(f"{qerl_server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "/dashboard/static/vendor/uPlot.iife.min.js" in page.text
    js = httpx.get(f"{qerl_server.url}/dashboard/static/vendor/uPlot.iife.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{qerl_server.url}/dashboard/static/vendor/uPlot.LICENSE").status_code == 200
    for path in ("../routes.py", "..%2froutes.py", "index.html", "nope.js"):
        resp = httpx.get(f"{qerl_server.url}/dashboard/static/{path}")
        assert resp.status_code == 404 and "error" in resp.json(), path


@needs_chromium
def test_job_page_follows_a_running_job_live(browser, cli_job: CliJob, qerl_server: Served) -> None:
    """Opened while the job is queued, the page fills its charts and ends at 'succeeded' from the
    event stream alone (no reload)."""
    from selenium.webdriver.common.by import By

    driver = browser
    driver.get(f"{qerl_server.url}/")
    driver.execute_script("localStorage.setItem('qerl.apiKey', arguments[0])", qerl_server.api_key)
    body = yaml.safe_load(JOB_SPEC_YAML) | {"training_file": cli_job.file_id, "seed": 5}
    body["qerl"]["steps"] = 3
    resp = httpx.post(f"{qerl_server.url}/v1/fine_tuning/jobs", json=body, headers=qerl_server.headers)
    assert resp.status_code == 200, resp.text
    job_id = resp.json()["id"]
    driver.get(f"{qerl_server.url}/#/jobs/{job_id}")
    driver.refresh()
    _wait(driver, lambda d: d.find_element(By.ID, "job-id").text == job_id and d.execute_script(
        "return document.getElementById('main').dataset.status"), what="the job page")
    driver.execute_script("window.__sameDocument = true")
    first = driver.execute_script("return document.getElementById('main').dataset.status")
    _wait(driver, lambda d: d.execute_script("return document.getElementById('main').dataset.streamEnded"),
          timeout=500, what="the job to finish on the page")
    assert first in ("validating_files", "queued", "running"), first
    assert driver.execute_script("return window.__sameDocument") is True
    final = httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()
    assert final["status"] == "succeeded", final["error"]
    assert driver.find_element(By.ID, "job-status").text == "succeeded"
    points = driver.execute_script("return Object.fromEntries([...document.querySelectorAll('.chart')]"
                                   ".map(c => [c.dataset.metric, +c.dataset.points]))")
    assert points["reward"] == 3 + 2 and points["tokens_per_s"] == 3 and points["aqn_sigma"] == 3, points
    events = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#events li")]
    assert any("Step 3/3" in e for e in events) and "successfully completed" in events[0]


@needs_chromium
def test_pause_resume_and_cancel_buttons_drive_a_running_job(browser, cli_job: CliJob, qerl_server: Served) -> None:
    """Each button shows only where the API allows it, and its click moves the job: running ->
    paused (the engine saved a checkpoint) -> queued/running again -> cancelled."""
    from selenium.webdriver.common.by import By

    driver = browser
    body = yaml.safe_load(JOB_SPEC_YAML) | {"training_file": cli_job.file_id, "seed": 7}
    body["qerl"].update(steps=300, checkpoint_interval=0)
    resp = httpx.post(f"{qerl_server.url}/v1/fine_tuning/jobs", json=body, headers=qerl_server.headers)
    assert resp.status_code == 200, resp.text
    job_id = resp.json()["id"]
    url = f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}"
    driver.get(f"{qerl_server.url}/")
    driver.execute_script("localStorage.setItem('qerl.apiKey', arguments[0])", qerl_server.api_key)
    driver.get(f"{qerl_server.url}/#/jobs/{job_id}")
    driver.refresh()

    def shown(d) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
        return tuple(d.execute_script("return ['pause', 'resume', 'cancel'].filter("
                                      "a => !document.getElementById(`job-${a}`).hidden)"))

    def status(d) -> str:  # type: ignore[no-untyped-def]  (the badge is replaced on every update)
        return d.execute_script("return document.getElementById('job-status').textContent")

    _wait(driver, lambda d: status(d) == "running" and httpx.get(url, headers=qerl_server.headers).json()[
        "qerl"]["progress"]["step"] >= 1, timeout=120, what="the job to run")
    assert shown(driver) == ("pause", "cancel")
    driver.find_element(By.ID, "job-pause").click()
    _wait(driver, lambda d: status(d) == "paused", timeout=60, what="the job to pause")
    assert shown(driver) == ("resume", "cancel")
    paused = httpx.get(url, headers=qerl_server.headers).json()
    assert paused["status"] == "paused" and 1 <= paused["qerl"]["progress"]["step"] < 300
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard-paused-job.png"))
    driver.find_element(By.ID, "job-resume").click()
    _wait(driver, lambda d: status(d) in ("queued", "running"), timeout=30, what="the job to resume")
    _wait(driver, lambda d: httpx.get(url, headers=qerl_server.headers).json()["qerl"]["attempt"] == 2,
          timeout=120, what="a worker to take the resumed job")
    driver.find_element(By.ID, "job-cancel").click()
    _wait(driver, lambda d: status(d) == "cancelled", timeout=60, what="the job to be cancelled")
    assert shown(driver) == ()
    messages = [e["message"] for e in httpx.get(f"{url}/events", params={"limit": 1000},
                                                headers=qerl_server.headers).json()["data"]]
    step = paused["qerl"]["progress"]["step"]
    assert f"Resuming from checkpoint step {step} (attempt 2)" in messages


@needs_chromium
def test_a_queued_jobs_page_shows_its_place_in_the_queue(browser, cli_job: CliJob, qerl_server: Served) -> None:
    """While the only worker runs a long job, a second job waits: its page says it is next."""
    from selenium.webdriver.common.by import By

    def create(steps: int) -> str:
        body = yaml.safe_load(JOB_SPEC_YAML) | {"training_file": cli_job.file_id, "seed": 9}
        body["qerl"].update(steps=steps, checkpoint_interval=0)
        resp = httpx.post(f"{qerl_server.url}/v1/fine_tuning/jobs", json=body, headers=qerl_server.headers)
        assert resp.status_code == 200, resp.text
        return resp.json()["id"]

    def job(job_id: str) -> dict:
        return httpx.get(f"{qerl_server.url}/v1/fine_tuning/jobs/{job_id}", headers=qerl_server.headers).json()

    busy = create(300)
    driver = browser
    try:
        _wait(driver, lambda d: job(busy)["status"] == "running", timeout=120, what="the first job to run")
        waiting = create(2)
        assert job(waiting)["qerl"]["queue_position"] == 1
        driver.get(f"{qerl_server.url}/")
        driver.execute_script("localStorage.setItem('qerl.apiKey', arguments[0])", qerl_server.api_key)
        driver.get(f"{qerl_server.url}/#/jobs/{waiting}")
        driver.refresh()

        def facts(d) -> dict:  # type: ignore[no-untyped-def]  (read at once: the page re-renders them)
            return d.execute_script("return Object.fromEntries([...document.querySelectorAll('#job-facts > div')]"
                                    ".map(e => [e.querySelector('dt').textContent, e.querySelector('dd').textContent]))")

        _wait(driver, lambda d: d.find_element(By.ID, "job-id").text == waiting and "Queue position" in facts(d),
              what="the queued job's page")
        assert facts(driver)["Queue position"] == "1 (1: next to start)"
        driver.get(f"{qerl_server.url}/#/")  # the jobs list marks it too
        _wait(driver, lambda d: d.execute_script(
            "const r = document.querySelector(`tr[data-job-id='${arguments[0]}'] .place`); return r && r.textContent",
            waiting) == " #1", what="the queued job's place in the list")
    finally:
        for jid in (busy, *([waiting] if "waiting" in locals() else [])):
            httpx.post(f"{qerl_server.url}/v1/fine_tuning/jobs/{jid}/cancel", headers=qerl_server.headers)
    _wait(driver, lambda d: job(busy)["status"] == "cancelled", timeout=60, what="the first job to be cancelled")


@needs_chromium
def test_a_job_that_stopped_early_shows_as_done(browser, cli_job: CliJob, qerl_server: Served) -> None:
    """A job early_stop_patience ended (a learning rate too small to move the LoRA: its first
    evaluation is no better than the start) succeeds short of its steps: its page's bar is full and
    its progress says it stopped early, as does its row in the jobs list."""
    from selenium.webdriver.common.by import By

    body = yaml.safe_load(JOB_SPEC_YAML) | {"training_file": cli_job.file_id}
    body["qerl"].update(steps=5, checkpoint_interval=0, eval_interval=1, early_stop_patience=1,
                        aqn={"enabled": False}, optim={"lr": 1e-12})
    driver = browser
    done = _ended_job(driver, qerl_server, body)
    job_id = done["id"]
    assert done["status"] == "succeeded" and done["qerl"]["progress"] == {"step": 1, "total_steps": 5,
                                                                        "stopped_early": True}, done
    _open_job_page(driver, qerl_server, job_id)
    _wait(driver, lambda d: d.find_element(By.ID, "job-id").text == job_id and d.execute_script(
        "const e = [...document.querySelectorAll('#job-facts > div')].find(e => e.querySelector('dt').textContent"
        " === 'Progress'); return e && e.querySelector('dd').textContent") == "1 / 5 steps (stopped early)",
          what="the job's progress")
    assert driver.execute_script("return document.getElementById('job-bar').style.width") == "100%"
    driver.get(f"{qerl_server.url}/#/")
    _wait(driver, lambda d: d.execute_script(
        "const r = document.querySelector(`tr[data-job-id='${arguments[0]}']`); return r && r.textContent",
        job_id) is not None, what="the job's row")
    cell = driver.execute_script(
        "const r = document.querySelector(`tr[data-job-id='${arguments[0]}'] td:nth-child(4)`);"
        "return [r.textContent, r.querySelector('.mini > span').style.width]", job_id)
    assert cell == ["1/5 early", "100%"], cell


@needs_chromium
def test_a_succeeded_jobs_adapter_is_evaluated_from_its_page(browser, cli_job: CliJob, qerl_server: Served) -> None:
    """A succeeded job's page offers its adapter's evaluation on an uploaded file: the button creates
    it (POST /v1/evaluations), the server's worker runs it, and its row shows the numbers the API
    holds beside the base alone's, with every row's answers to download."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    _open_job_page(driver, qerl_server, cli_job.job_id)
    _wait(driver, lambda d: d.find_elements(By.ID, "eval-run"), what="the evaluation form")
    shown_ids = "return [...document.querySelectorAll('#evaluations-table tbody tr')].map(r => r.dataset.evaluationId)"
    earlier = set(driver.execute_script(shown_ids))  # the model's evaluations other tests made
    Select(driver.find_element(By.ID, "eval-file")).select_by_value(cli_job.file_id)  # the training rows, as a test
    driver.find_element(By.ID, "eval-run").click()
    ev_id = _wait(driver, lambda d: next((i for i in d.execute_script(shown_ids) if i not in earlier), None),
                  what="the new evaluation's row")
    row = f"#evaluations-table tr[data-evaluation-id='{ev_id}']"
    _wait(driver, lambda d: d.execute_script(
        f"const r = document.querySelector(\"{row}\"); return r && r.querySelector('[data-status]').dataset.status")
          == "succeeded", timeout=300, what="the evaluation to succeed")
    ev = httpx.get(f"{qerl_server.url}/v1/evaluations/{ev_id}", headers=qerl_server.headers).json()
    assert (ev["model"], ev["file"], ev["status"]) == (cli_job.job["fine_tuned_model"], cli_job.file_id, "succeeded")
    result = ev["result"]

    def shown(k: str) -> str:
        tuned, alone = result["fine_tuned"][k], result["base"][k]
        return f"{float(f'{tuned:.3g}'):g} (base {float(f'{alone:.3g}'):g})"

    cells = driver.execute_script(
        f"const r = document.querySelector(\"{row}\"); return [r.querySelector('.eval-accuracy').textContent,"
        " r.querySelector('.eval-reward').textContent]")
    assert cells == [shown("accuracy"), shown("reward_mean")], (cells, result)
    driver.find_element(By.CSS_SELECTOR, f"{row} .eval-rows").click()
    _wait(driver, lambda d: d.execute_script(
        f"return document.querySelector(\"{row} .eval-rows\").nextSibling.nextSibling.textContent")
          in ("sha256 verified", "downloaded"), what="the rows download")
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard-evaluation.png"))


@needs_chromium
def test_a_job_trained_on_a_task_is_evaluated_on_its_fresh_questions(browser, qerl_server: Served) -> None:
    """A job trained on a reasoning-gym task offers its fresh questions first (no file needed): the
    evaluation it creates draws them as `qerl eval --task` does, and its row says what it scored."""
    from selenium.webdriver.common.by import By

    body = yaml.safe_load(JOB_SPEC_YAML)
    body["qerl"].update(steps=1, checkpoint_interval=0, dataset={"source": "reasoning_gym", "task": "products",
                                                                  "size": 16})
    driver = browser
    done = _ended_job(driver, qerl_server, body)
    assert done["status"] == "succeeded", done
    _open_job_page(driver, qerl_server, done["id"])
    _wait(driver, lambda d: d.find_elements(By.ID, "eval-run"), what="the evaluation form")
    first = driver.execute_script("const o = document.querySelector('#eval-file option'); return [o.value, o.text]")
    assert first == ["task:products", "50 fresh questions of products"], first
    driver.find_element(By.ID, "eval-run").click()  # the first option, selected
    row = "#evaluations-table tbody tr"
    _wait(driver, lambda d: d.execute_script(
        f"const r = document.querySelector('{row}'); return r && r.querySelector('[data-status]').dataset.status")
          == "succeeded", timeout=300, what="the evaluation to succeed")
    ev_id = driver.execute_script(f"return document.querySelector('{row}').dataset.evaluationId")
    ev = httpx.get(f"{qerl_server.url}/v1/evaluations/{ev_id}", headers=qerl_server.headers).json()
    assert (ev["file"], ev["dataset"], ev["result"]["rows"]) == (None, {"task": "products", "size": 50, "seed": None},
                                                                 50), ev
    assert driver.execute_script(f"return document.querySelector('{row} .eval-rows-of').textContent") == \
        "50 questions of products"
