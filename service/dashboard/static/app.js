/* qerl dashboard: a jobs list and a job page with live training curves.
 *
 * Talks to the JSON API of the server that served it, with the API key the user pasted (kept in
 * localStorage, sent as "Authorization: Bearer"). EventSource cannot send that header, so the
 * job's event stream is read with fetch() and parsed here (server-sent events: "id:", "event:",
 * "data:" lines, a blank line ends an event). Metrics come from GET .../metrics once, then from
 * the stream's "metrics" events; evaluation results are re-read from .../metrics when the
 * engine announces them. Each chart exposes data-points (points drawn) for tests.
 */
(() => {
  'use strict';

  const KEY_STORE = 'qerl.apiKey';
  const TERMINAL = ['succeeded', 'failed', 'cancelled'];
  const EVAL_QUESTIONS = 50; // a job trained on a reasoning-gym task is evaluated on this many fresh questions
  const TRAIN = '#2f6fde', EVAL = '#e8590c';
  const CHARTS = [
    { id: 'reward', title: 'Reward', series: [{ key: 'reward_mean', label: 'train', color: TRAIN },
                                               { key: 'eval/reward_mean', label: 'eval', color: EVAL }] },
    { id: 'accuracy', title: 'Accuracy', range: [0, 1],
      series: [{ key: 'accuracy', label: 'train', color: TRAIN }, { key: 'eval/accuracy', label: 'eval', color: EVAL }] },
    { id: 'entropy', title: 'Entropy', series: [{ key: 'entropy', label: 'entropy', color: TRAIN }] },
    { id: 'kl', title: 'KL', series: [{ key: 'kl', label: 'kl', color: TRAIN }] },
    { id: 'aqn_sigma', title: 'AQN σ', series: [{ key: 'aqn_sigma', label: 'sigma', color: TRAIN }] },
    { id: 'tokens_per_s', title: 'Rollout tokens/s', series: [{ key: 'rollout_tokens_per_s', label: 'tok/s', color: TRAIN }] },
  ];

  const main = document.getElementById('main');
  let apiKey = localStorage.getItem(KEY_STORE) || '';
  let view = null; // the current page's { dispose() }

  // ---- small helpers -------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') node.className = v;
      else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
    return node;
  }
  const when = (ts) => (ts ? new Date(ts * 1000).toLocaleString() : '–');
  const clock = (ts) => (ts ? new Date(ts * 1000).toLocaleTimeString() : '');
  const num = (v) => (typeof v === 'number' && Number.isFinite(v) ? v : null);
  function fmt(v) {
    if (v === null || v === undefined) return '–';
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
    return a >= 100 ? v.toFixed(0) : String(+v.toPrecision(3));
  }
  // Python's '{:g}', so that the Settings panel reads as `qerl jobs get` prints the same spec.
  function g(v) {
    if (typeof v !== 'number' || !Number.isFinite(v)) return String(v);
    if (v === 0) return '0';
    const [mant, exp] = v.toExponential(5).split('e');
    const e = Number(exp);
    const m = mant.replace(/\.?0+$/, '');
    if (e < -4 || e >= 6) return `${m}e${e < 0 ? '-' : '+'}${String(Math.abs(e)).padStart(2, '0')}`;
    return String(Number(v.toPrecision(6)));
  }
  // A job's training settings in a few lines (qerl.compare.settings, which `qerl jobs get` prints).
  function settings(spec) {
    if (!spec) return [];
    const rl = spec.rl || {}, lora = spec.lora || {}, optim = spec.optim || {}, r = spec.rollout || {};
    const aqn = spec.aqn || {}, data = spec.data || {}, grader = spec.grader || {};
    const held = data.eval_size || 0;
    let evaluation = data.validation_file ? `${held} rows of the validation file`
      : (held ? `${held} held-out prompts` : 'none held out');
    if (held || data.validation_file) {
      evaluation += spec.eval_interval ? `, every ${spec.eval_interval} steps` : ', at the start and the end';
    }
    return [
      ['Algorithm', `${rl.algorithm || ''}` + (rl.kl_coef ? `, KL ${g(rl.kl_coef)}` : '')],
      ['LoRA', `r=${lora.r}, alpha=${g(lora.alpha || 0)}` + (lora.use_rslora ? ', rsLoRA' : '')],
      ['Learning rate', `${g(optim.lr || 0)} (${optim.schedule || ''}, warmup ${g(optim.warmup_ratio || 0)})`],
      ['Rollouts', `${spec.prompts_per_step} prompts x ${r.num_generations} samples a step, up to `
        + `${r.max_new_tokens} tokens, temperature ${g(r.temperature ?? 1)}`],
      ['AQN', aqn.enabled ? `sigma ${g(aqn.sigma_start || 0)} -> ${g(aqn.sigma_end || 0)} in ${aqn.stages} stages` : 'off'],
      ['Evaluation', evaluation],
      ['Early stop', spec.early_stop_patience
        ? `after ${spec.early_stop_patience} evaluations without a higher held-out reward` : 'off'],
      ['Grader', `${grader.type || ''} ${grader.name || ''}`.trim()],
    ];
  }
  // Axis ticks with as many decimals as the tick spacing needs (10.436 vs 10.438, not 10.4 twice).
  function ticks(_u, splits, _axis, _space, incr) {
    const big = Math.max(...splits.map((v) => Math.abs(v)));
    if (big !== 0 && (big < 1e-3 || big >= 1e6)) {
      const digits = Math.max(0, Math.min(3, Math.ceil(Math.log10(big / incr) - 1e-9)));
      return splits.map((v) => v.toExponential(digits));
    }
    const step = String(+incr.toPrecision(6));
    const decimals = step.includes('e') ? Math.min(8, Math.ceil(-Math.log10(incr))) : (step.split('.')[1] || '').length;
    return splits.map((v) => v.toFixed(decimals));
  }
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 50000, 100000];
  function size(n) {
    const units = ['B', 'KiB', 'MiB', 'GiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : n) + ' ' + units[i];
  }
  function badge(status) { return el('span', { class: `badge ${status}`, 'data-status': status }, status); }
  function clone(id) { return document.getElementById(id).content.cloneNode(true); }

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(path, opts = {}) {
    const headers = Object.assign({ Authorization: `Bearer ${apiKey}` }, opts.headers || {});
    const res = await fetch(path, Object.assign({}, opts, { headers }));
    if (res.ok) return res;
    let message = `${res.status} ${res.statusText}`;
    try { message = (await res.json()).error.message || message; } catch (_) { /* not JSON */ }
    if (res.status === 401) { forgetKey(); route(); }
    throw new ApiError(res.status, message);
  }
  const getJSON = async (path, opts) => (await api(path, opts)).json();

  // Server-sent events over fetch (so the Authorization header can be sent).
  async function streamEvents(path, lastId, signal, onEvent) {
    const headers = { Accept: 'text/event-stream' };
    if (lastId) headers['Last-Event-ID'] = lastId;
    const res = await api(path, { headers, signal });
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = '', data = [], id = null, type = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buf.indexOf('\n')) >= 0) {
        let line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        if (line.endsWith('\r')) line = line.slice(0, -1);
        if (line === '') {
          if (data.length) {
            let payload = data.join('\n');
            try { payload = JSON.parse(payload); } catch (_) { /* plain text */ }
            if (onEvent({ id, type, data: payload }) === false) { reader.cancel(); return; }
          }
          data = []; type = null;
          continue;
        }
        if (line[0] === ':') continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let val = colon < 0 ? '' : line.slice(colon + 1);
        if (val[0] === ' ') val = val.slice(1);
        if (field === 'data') data.push(val);
        else if (field === 'id') id = val;
        else if (field === 'event') type = val;
      }
    }
  }

  // ---- key handling --------------------------------------------------------------------------
  function forgetKey() {
    apiKey = '';
    localStorage.removeItem(KEY_STORE);
    showKeyStatus();
  }
  function showKeyStatus() {
    document.getElementById('key-status').textContent = apiKey ? `key ${apiKey.slice(0, 10)}…` : '';
    document.getElementById('forget-key').hidden = !apiKey;
  }
  document.getElementById('forget-key').addEventListener('click', () => { forgetKey(); route(); });

  function renderLogin() {
    main.replaceChildren(clone('tpl-login'));
    const form = document.getElementById('login-form');
    const error = document.getElementById('login-error');
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      const candidate = document.getElementById('api-key').value.trim();
      const res = await fetch('/v1/fine_tuning/jobs?limit=1', { headers: { Authorization: `Bearer ${candidate}` } });
      if (!res.ok) {
        let msg = `${res.status}`;
        try { msg = (await res.json()).error.message; } catch (_) { /* keep the status */ }
        error.textContent = msg;
        error.hidden = false;
        return;
      }
      apiKey = candidate;
      localStorage.setItem(KEY_STORE, apiKey);
      showKeyStatus();
      route();
    });
    return { dispose() {} };
  }

  // ---- jobs list -----------------------------------------------------------------------------
  function renderJobs() {
    main.replaceChildren(clone('tpl-jobs'));
    const tbody = document.querySelector('#jobs-table tbody');
    const more = document.getElementById('jobs-more');
    const filter = document.getElementById('status-filter');
    let pages = 1, timer = null, disposed = false;

    function row(j) {
      const p = j.qerl.progress;
      const pct = p.stopped_early ? 100 : p.total_steps ? Math.round((100 * p.step) / p.total_steps) : 0;
      return el('tr', { class: 'job-row', 'data-job-id': j.id, 'data-status': j.status },
        el('td', {}, el('a', { href: `#/jobs/${j.id}` }, j.id)),
        el('td', {}, badge(j.status), j.qerl.queue_position
          ? el('span', { class: 'place', title: 'place in the queue (1: next to start)' }, ` #${j.qerl.queue_position}`) : null),
        el('td', {}, j.model),
        el('td', {}, el('span', { class: 'mini' }, el('span', { style: `width:${pct}%` })), `${p.step}/${p.total_steps}`,
          p.stopped_early ? el('span', { class: 'early', title: 'ended by early_stop_patience' }, ' early') : null),
        el('td', {}, when(j.created_at)),
        el('td', { class: 'wrap' }, j.fine_tuned_model || ''));
    }

    async function load() {
      const rows = [];
      let after = null, hasMore = false;
      for (let i = 0; i < pages; i += 1) {
        const q = new URLSearchParams({ limit: '20' });
        if (after) q.set('after', after);
        if (filter.value) q.set('status', filter.value);
        const page = await getJSON(`/v1/fine_tuning/jobs?${q}`);
        rows.push(...page.data);
        hasMore = page.has_more;
        if (!hasMore || !page.data.length) break;
        after = page.data[page.data.length - 1].id;
      }
      if (disposed) return;
      tbody.replaceChildren(...rows.map(row));
      document.getElementById('jobs-empty').hidden = rows.length > 0;
      more.hidden = !hasMore;
      main.dataset.loaded = 'jobs';
    }
    async function tick() {
      try { await load(); } catch (e) { if (!(e instanceof ApiError && e.status === 401)) console.error(e); }
      if (!disposed) timer = setTimeout(tick, 5000);
    }
    more.addEventListener('click', () => { pages += 1; load(); });
    filter.addEventListener('change', () => { pages = 1; load(); });
    tick();
    return { dispose() { disposed = true; clearTimeout(timer); } };
  }

  // ---- charts --------------------------------------------------------------------------------
  function makeChart(parent, def) {
    const plot = el('div', { class: 'plot' });
    const empty = el('div', { class: 'empty' }, 'no data yet');
    const latest = el('span', { class: 'latest' });
    const box = el('div', { class: 'chart', 'data-metric': def.id, 'data-points': '0', 'data-steps': '0' },
      el('h3', {}, def.title, latest), plot, empty);
    parent.append(box);
    let u = null;
    const resize = new ResizeObserver(() => { if (u) u.setSize({ width: plot.clientWidth, height: 210 }); });
    resize.observe(plot);

    function options() {
      return {
        width: plot.clientWidth || 380, height: 210,
        scales: { x: { time: false }, y: def.range ? { range: def.range } : {} },
        legend: { show: def.series.length > 1 },
        cursor: { drag: { x: true, y: false } },
        axes: [
          { label: 'step', labelSize: 14, size: 36, incrs: STEP_INCRS, values: (_u, vals) => vals.map(String) },
          { size: 60, values: ticks },
        ],
        series: [{ label: 'step' }].concat(def.series.map((s) => ({
          label: s.label, stroke: s.color, width: 2, spanGaps: true,
          points: { show: true, size: 5, fill: s.color },
          value: (_u, v) => fmt(v),
        }))),
      };
    }

    return {
      update(steps, store) {
        const xs = [];
        const ys = def.series.map(() => []);
        for (const step of steps) {
          const values = store.get(step);
          const ysHere = def.series.map((s) => num(values[s.key]));
          if (ysHere.every((y) => y === null)) continue;
          xs.push(step);
          ysHere.forEach((y, i) => ys[i].push(y));
        }
        const points = ys.reduce((n, arr) => n + arr.filter((y) => y !== null).length, 0);
        box.dataset.points = String(points);
        box.dataset.steps = String(xs.length);
        latest.textContent = def.series.map((s, i) => {
          const last = ys[i].filter((y) => y !== null).pop();
          return last === undefined ? '' : (def.series.length > 1 ? `${s.label} ${fmt(last)}` : fmt(last));
        }).filter(Boolean).join(' · ');
        empty.hidden = points > 0;
        if (!points) return;
        if (!u) u = new uPlot(options(), [xs, ...ys], plot);
        else u.setData([xs, ...ys]);
      },
      dispose() { resize.disconnect(); if (u) u.destroy(); },
    };
  }

  // ---- one job -------------------------------------------------------------------------------
  function renderJob(jobId) {
    main.replaceChildren(clone('tpl-job'));
    document.getElementById('job-id').textContent = jobId;
    const chartsBox = document.getElementById('charts');
    const charts = CHARTS.map((def) => makeChart(chartsBox, def));
    const store = new Map(); // step -> values
    const seenEvents = new Set();
    const abort = new AbortController();
    let job = null, disposed = false, timer = null, redraw = 0, metricsReload = null, lastStep = -1;

    function drawSoon() {
      if (redraw) return;
      redraw = requestAnimationFrame(() => {
        redraw = 0;
        const steps = [...store.keys()].sort((a, b) => a - b);
        charts.forEach((c) => c.update(steps, store));
      });
    }
    function putMetrics(step, values) {
      store.set(step, Object.assign(store.get(step) || {}, values));
      drawSoon();
    }
    async function loadMetrics() {
      let after = null;
      for (;;) {
        const q = after === null ? '' : `?after_step=${after}`;
        const page = await getJSON(`/v1/fine_tuning/jobs/${jobId}/metrics${q}`, { signal: abort.signal });
        page.data.forEach((m) => putMetrics(m.step, m.values));
        if (!page.has_more || !page.data.length) break;
        after = page.data[page.data.length - 1].step;
      }
      main.dataset.metricsLoaded = String(store.size);
    }
    function reloadMetricsSoon() {
      clearTimeout(metricsReload);
      metricsReload = setTimeout(() => loadMetrics().catch(() => {}), 800);
    }

    function showJob(j) {
      job = j;
      const p = j.qerl.progress;
      const status = document.getElementById('job-status');
      status.replaceWith(Object.assign(badge(j.status), { id: 'job-status' }));
      // a job early_stop_patience ended is done: its bar is full, its steps say why they are fewer
      document.getElementById('job-bar').style.width = p.stopped_early ? '100%'
        : p.total_steps ? `${(100 * p.step) / p.total_steps}%` : '0';
      const facts = [
        ['Model', j.model], ['Progress', `${p.step} / ${p.total_steps} steps${p.stopped_early ? ' (stopped early)' : ''}`],
        ['Quantization', j.qerl.quantization], ['Attempt', `${j.qerl.attempt} / ${j.qerl.max_attempts}`],
        ['Training file', j.training_file || (j.qerl.dataset ? `${j.qerl.dataset.source}:${j.qerl.dataset.task}` : '–')],
        ['Created', when(j.created_at)], ['Started', when(j.qerl.started_at)], ['Finished', when(j.finished_at)],
        ['Fine-tuned model', j.fine_tuned_model || '–'], ['Trained tokens', j.trained_tokens ?? '–'],
      ];
      if (j.qerl.queue_position) facts.splice(2, 0, ['Queue position', `${j.qerl.queue_position} (1: next to start)`]);
      const dl = (pairs) => pairs.map(([k, v]) => el('div', {}, el('dt', {}, k), el('dd', { title: String(v) }, v)));
      document.getElementById('job-facts').replaceChildren(...dl(facts));
      document.getElementById('job-settings').replaceChildren(...dl(settings(j.qerl.spec)));
      const err = document.getElementById('job-error');
      err.hidden = !j.error;
      err.textContent = j.error ? `${j.error.code}: ${j.error.message}` : '';
      const cancel = document.getElementById('job-cancel');
      cancel.hidden = TERMINAL.includes(j.status) || j.status === 'cancelling';
      document.getElementById('job-pause').hidden = !['validating_files', 'queued', 'running'].includes(j.status);
      document.getElementById('job-resume').hidden = j.status !== 'paused';
      main.dataset.status = j.status;
      if (p.step !== lastStep) { lastStep = p.step; loadCheckpoints(); loadSamples(); }
      if (j.qerl.adapter_id) showAdapter(j.qerl.adapter_id, j.result_files || []);
    }

    let samplesStep = null; // null: follow the newest step
    async function loadSamples() {
      const q = samplesStep === null ? '' : `?step=${samplesStep}`;
      const page = await getJSON(`/v1/fine_tuning/jobs/${jobId}/samples${q}`, { signal: abort.signal });
      const rows = page.data.map((x) => el('tr', { 'data-kind': x.kind },
        el('td', {}, x.step), el('td', {}, x.kind), el('td', {}, x.index), el('td', {}, fmt(x.reward)),
        el('td', { class: 'wrap sample', title: x.prompt }, x.completion)));
      document.querySelector('#samples tbody').replaceChildren(...rows);
      document.getElementById('samples-empty').hidden = rows.length > 0;
      document.getElementById('samples-step').textContent = page.data.length ? `step ${page.data[0].step}` : '';
    }
    document.getElementById('samples-pick').addEventListener('change', (e) => {
      const v = e.target.value.trim();
      samplesStep = v === '' ? null : Math.max(0, Math.floor(Number(v)));
      loadSamples().catch(() => {});
    });

    async function loadCheckpoints() {
      const page = await getJSON(`/v1/fine_tuning/jobs/${jobId}/checkpoints?limit=100`, { signal: abort.signal });
      const rows = page.data.slice().sort((a, b) => a.step_number - b.step_number).map((c) => {
        const kept = (c.qerl && c.qerl.adapter_sha256) || null; // kept for good (keep_checkpoint_adapters)
        const status = el('span', { class: 'muted' }, kept ? 'kept' : '');
        const get = el('button', { type: 'button', class: 'ckpt-download', onclick: () => download(
          `/v1/fine_tuning/jobs/${jobId}/checkpoints/${c.id}/content`, `${jobId}-ckpt-step-${c.step_number}.tar.gz`,
          kept, status) }, 'download');
        return el('tr', { 'data-step': c.step_number },
          el('td', {}, c.step_number), el('td', { class: 'wrap' }, c.fine_tuned_model_checkpoint),
          el('td', {}, fmt(num(c.metrics.reward_mean))), el('td', {}, fmt(num(c.metrics['eval/reward_mean']))),
          el('td', {}, when(c.created_at)), el('td', {}, get, ' ', status));
      });
      document.querySelector('#checkpoints tbody').replaceChildren(...rows);
    }

    // Evaluations of the adapter (POST /v1/evaluations): run by the server's workers, listed
    // newest first, re-read every 2 s while one is queued or running.
    let evalModel = null, evalTimer = null;
    async function loadEvaluations() {
      clearTimeout(evalTimer);
      const [files, page] = await Promise.all([
        getJSON('/v1/files?purpose=fine-tune&limit=500', { signal: abort.signal }),
        getJSON(`/v1/evaluations?limit=100&model=${encodeURIComponent(evalModel)}`, { signal: abort.signal })]);
      const chosen = (document.getElementById('eval-file') || {}).value;
      const task = job && job.qerl.dataset ? job.qerl.dataset.task : null; // trained on a task: its fresh questions
      const pick = el('select', { id: 'eval-file' },
        ...(task ? [el('option', { value: `task:${task}`, selected: chosen === `task:${task}` },
          `${EVAL_QUESTIONS} fresh questions of ${task}`)] : []),
        ...files.data.map((f) => el('option', { value: f.id, selected: f.id === chosen }, `${f.filename} (${f.id})`)));
      const said = el('span', { class: 'muted', id: 'eval-said' });
      const run = el('button', { type: 'button', id: 'eval-run', disabled: !pick.options.length, onclick: async () => {
        run.disabled = true;
        try {
          await getJSON('/v1/evaluations', { method: 'POST', headers: { 'Content-Type': 'application/json' },
            body: JSON.stringify(pick.value.startsWith('task:')
              ? { model: evalModel, dataset: { task: pick.value.slice(5), size: EVAL_QUESTIONS } }
              : { model: evalModel, file: pick.value }) });
          await loadEvaluations();
        } catch (e) { said.textContent = e.message; said.className = 'error'; run.disabled = false; }
      } }, 'Evaluate on this file');
      const side = (r, k) => (r ? `${fmt(num(r.fine_tuned[k]))}${r.base ? ` (base ${fmt(num(r.base[k]))})` : ''}` : '–');
      const rows = page.data.map((ev) => {
        const done = el('span', { class: 'muted' });
        const get = ev.result_files.length ? el('button', { type: 'button', class: 'eval-rows', onclick: () => download(
          `/v1/files/${ev.result_files[0]}/content`, `${ev.id}-rows.jsonl`, null, done) }, 'rows (.jsonl)') : '';
        return el('tr', { 'data-evaluation-id': ev.id },
          el('td', { class: 'wrap' }, ev.id),
          el('td', { class: 'eval-rows-of' }, ev.file || (ev.dataset ? `${ev.dataset.size} questions of ${ev.dataset.task}` : '–')),
          el('td', {}, badge(ev.status)),
          el('td', { class: 'eval-accuracy' }, side(ev.result, 'accuracy')),
          el('td', { class: 'eval-reward' }, side(ev.result, 'reward_mean')),
          el('td', {}, get, ' ', done, ev.error ? el('span', { class: 'error' }, `${ev.error.code}: ${ev.error.message}`) : ''));
      });
      document.getElementById('evaluations').replaceChildren(
        el('p', {}, pick, ' ', run, ' ', said),
        el('table', { class: 'grid', id: 'evaluations-table' },
          el('thead', {}, el('tr', {}, ...['Evaluation', 'Test rows', 'Status', 'Accuracy', 'Reward', 'Rows'].map((h) => el('th', {}, h)))),
          el('tbody', {}, ...rows)),
        el('pre', { class: 'cmd' }, `qerl eval ${jobId} --file test.jsonl --on-server`));
      if (!disposed && page.data.some((ev) => !TERMINAL.includes(ev.status))) {
        evalTimer = setTimeout(() => loadEvaluations().catch(() => {}), 2000);
      }
    }

    let adapterShown = null;
    async function showAdapter(adapterId, resultFiles) {
      if (adapterShown === adapterId) return;
      adapterShown = adapterId;
      const a = await getJSON(`/v1/adapters/${adapterId}`, { signal: abort.signal });
      evalModel = a.name;
      loadEvaluations().catch(() => {});
      const status = el('span', { class: 'muted' });
      const button = el('button', { type: 'button', id: 'adapter-download', onclick: () => download(`/v1/adapters/${a.id}/content`, `${a.id}.tar.gz`, a.sha256, status) },
        'Download adapter (.tar.gz)');
      document.getElementById('adapter').replaceChildren(
        el('dl', { class: 'adapter-meta' },
          el('dt', {}, 'Adapter'), el('dd', {}, a.id), el('dt', {}, 'Name'), el('dd', {}, a.name),
          el('dt', {}, 'Base model'), el('dd', {}, a.base_model), el('dt', {}, 'Size'), el('dd', {}, size(a.bytes)),
          el('dt', {}, 'sha256'), el('dd', {}, el('code', {}, a.sha256))),
        button, ' ', status,
        el('pre', { class: 'cmd' }, `qerl adapters download ${a.id} -o ./${a.id}`),
        ...resultFiles.map((f) => {
          const done = el('span', { class: 'muted', id: 'results-status' });
          return el('p', {}, el('button', { type: 'button', id: 'results-download', onclick: () => download(
            `/v1/files/${f}/content`, `${jobId}-step_metrics.csv`, null, done) }, 'Download every step\'s metrics (.csv)'),
          ' ', done);
        }));
    }

    async function download(path, filename, sha256, status) {
      status.textContent = 'downloading…';
      try {
        const res = await api(path);
        const blob = await res.blob();
        const expected = res.headers.get('X-Checksum-Sha256') || sha256;
        if (!expected) throw new Error('the server sent no X-Checksum-Sha256: the download cannot be verified');
        let note = '';
        if (window.crypto && crypto.subtle) {
          const digest = await crypto.subtle.digest('SHA-256', await blob.arrayBuffer());
          const hex = [...new Uint8Array(digest)].map((b) => b.toString(16).padStart(2, '0')).join('');
          if (hex !== expected) throw new Error(`sha256 ${hex} does not match the server's ${expected}`);
          note = 'sha256 verified';
        }
        const url = URL.createObjectURL(blob);
        const link = el('a', { href: url, download: filename });
        document.body.append(link);
        link.click();
        link.remove();
        setTimeout(() => URL.revokeObjectURL(url), 10000);
        status.textContent = note || 'downloaded';
        status.className = 'ok';
      } catch (e) {
        status.textContent = e.message;
        status.className = 'error';
      }
    }

    function addEvent(ev) {
      if (!ev || !ev.id || seenEvents.has(ev.id)) return;
      seenEvents.add(ev.id);
      const list = document.getElementById('events');
      const item = el('li', { class: `lvl-${ev.level} type-${ev.type}`, 'data-event-id': ev.id },
        el('time', {}, clock(ev.created_at)), el('span', {}, ev.message));
      list.prepend(item); // newest first
      while (list.children.length > 500) list.lastChild.remove();
    }

    function onStreamEvent(sse) {
      if (sse.type === 'done') return false;
      const ev = sse.data;
      if (!ev || typeof ev !== 'object') return true;
      addEvent(ev);
      if (ev.type === 'metrics' && ev.data && typeof ev.data.step === 'number') {
        const values = Object.assign({}, ev.data);
        delete values.step;
        delete values.total_steps;
        putMetrics(ev.data.step, values);
      } else {
        reloadMetricsSoon(); // evaluations and checkpoints announce themselves with plain events
      }
      return true;
    }

    async function follow(lastId) {
      // lastId: the newest event already shown, so the stream delivers only what comes after it
      // (oldest first) and the list stays in order; metrics before it came from GET .../metrics.
      const live = document.getElementById('live');
      let failures = 0;
      while (!disposed) {
        try {
          live.textContent = '● live';
          await streamEvents(`/v1/fine_tuning/jobs/${jobId}/events`, lastId, abort.signal, (sse) => {
            if (sse.id) lastId = sse.id;
            failures = 0;
            return onStreamEvent(sse);
          });
        } catch (e) {
          if (disposed || (e instanceof ApiError && e.status < 500)) break;
          failures += 1;
        }
        live.textContent = '';
        const j = await getJSON(`/v1/fine_tuning/jobs/${jobId}`, { signal: abort.signal }).catch(() => null);
        if (j) showJob(j);
        if (j && TERMINAL.includes(j.status)) break;
        await new Promise((r) => setTimeout(r, Math.min(10000, 1000 * 2 ** failures)));
      }
      if (!disposed) { await loadMetrics().catch(() => {}); main.dataset.streamEnded = '1'; }
    }

    async function poll() {
      try {
        const j = await getJSON(`/v1/fine_tuning/jobs/${jobId}`, { signal: abort.signal });
        showJob(j);
        if (TERMINAL.includes(j.status)) { await loadCheckpoints(); return; }
      } catch (e) { if (disposed) return; }
      timer = setTimeout(poll, 3000);
    }

    for (const action of ['cancel', 'pause', 'resume']) {
      document.getElementById(`job-${action}`).addEventListener('click', async () => {
        try { showJob(await getJSON(`/v1/fine_tuning/jobs/${jobId}/${action}`, { method: 'POST' })); } catch (e) { alert(e.message); }
      });
    }

    (async () => {
      try {
        showJob(await getJSON(`/v1/fine_tuning/jobs/${jobId}`, { signal: abort.signal }));
      } catch (e) {
        if (!disposed) main.replaceChildren(el('section', { class: 'card' }, el('p', { class: 'error' }, e.message),
          el('a', { href: '#/' }, '← all jobs')));
        return;
      }
      const recent = await getJSON(`/v1/fine_tuning/jobs/${jobId}/events?limit=200`, { signal: abort.signal }).catch(() => ({ data: [] }));
      recent.data.slice().reverse().forEach(addEvent);
      await loadMetrics().catch(() => {});
      poll();
      follow(recent.data.length ? recent.data[0].id : null);
    })();

    return {
      dispose() {
        disposed = true;
        abort.abort();
        clearTimeout(timer);
        clearTimeout(metricsReload);
        clearTimeout(evalTimer);
        if (redraw) cancelAnimationFrame(redraw);
        charts.forEach((c) => c.dispose());
      },
    };
  }

  // ---- routing -------------------------------------------------------------------------------
  function route() {
    if (view) view.dispose();
    delete main.dataset.loaded;
    showKeyStatus();
    if (!apiKey) { view = renderLogin(); return; }
    const m = location.hash.match(/^#\/jobs\/([\w.-]+)$/);
    view = m ? renderJob(m[1]) : renderJobs();
  }
  window.addEventListener('hashchange', route);
  route();
})();
