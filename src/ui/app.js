// The subagents dashboard: one page, no build step, no dependencies. State lives in the URL
// (paths and query strings), data comes from the same /v1 API every client uses, and live
// updates come over SSE read with fetch (EventSource cannot send the Authorization header).
'use strict';

const KEY = 'subagents.key';
const TERMINAL = ['succeeded', 'failed', 'cancelled'];
const STATES = ['queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled'];
const main = document.getElementById('main');
/** Teardown of the current view (open streams), run on navigation. */
let teardown = [];

// ---------- small helpers ----------
function h(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else if (k === 'class') e.className = v;
    else e.setAttribute(k, v === true ? '' : v);
  }
  for (const k of kids.flat(Infinity)) {
    if (k == null || k === false) continue;
    e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  }
  return e;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const short = (id) => (id ? String(id).slice(-8) : '');
const link = (href, text, attrs) => h('a', Object.assign({ href }, attrs || {}), text);
const badge = (s) => h('span', { class: 'badge ' + s, 'data-status': s }, s);
function when(t) {
  if (!t) return '';
  const d = new Date(t);
  return d.toLocaleString(undefined, { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit', second: '2-digit' });
}
function dur(a, b) {
  if (!a) return '';
  const ms = (b ? new Date(b) : new Date()) - new Date(a);
  if (ms < 1000) return ms + ' ms';
  if (ms < 60000) return (ms / 1000).toFixed(1) + ' s';
  if (ms < 3600000) return Math.floor(ms / 60000) + ' m ' + Math.round((ms % 60000) / 1000) + ' s';
  return (ms / 3600000).toFixed(1) + ' h';
}
const num = (n) => (n == null ? '' : Number(n).toLocaleString());
function usd(x) {
  if (x == null) return '';
  if (x === 0) return '$0';
  return x < 0.01 ? '$' + x.toFixed(4) : '$' + x.toFixed(2);
}
function toast(text) {
  const t = h('div', { class: 'toast', role: 'status' }, text);
  document.body.append(t);
  setTimeout(() => t.remove(), 4000);
}
/** Shows the live state: `true` streaming, `false` reconnecting, a string for a stream that ended on purpose. */
function setLive(on) {
  const l = document.getElementById('live');
  l.classList.toggle('on', on === true);
  l.textContent = on === true ? 'live' : on === false ? 'offline' : on;
}
/** replaceChildren without the nulls and falses that conditional parts leave. */
function put(el, ...kids) {
  el.replaceChildren(...kids.flat(Infinity).filter((k) => k != null && k !== false));
}

// ---------- the key and the API ----------
function key() { return sessionStorage.getItem(KEY); }
let asking = null;
function askKey(message) {
  if (asking) return asking;
  const dlg = document.getElementById('keydlg');
  document.getElementById('keyerr').textContent = message || '';
  asking = new Promise((resolve) => {
    const form = document.getElementById('keyform');
    form.onsubmit = (ev) => {
      ev.preventDefault();
      const k = document.getElementById('keyinput').value.trim();
      if (!k) return;
      sessionStorage.setItem(KEY, k);
      viewer = null;
      document.getElementById('forget').hidden = false;
      dlg.close();
      asking = null;
      resolve();
    };
  });
  if (!dlg.open) dlg.showModal();
  return asking;
}
function headers(extra) {
  const hd = Object.assign({ Accept: 'application/json' }, extra || {});
  if (key()) hd.Authorization = 'Bearer ' + key();
  return hd;
}
async function api(method, path, body) {
  for (;;) {
    const init = { method, headers: headers(body === undefined ? {} : { 'Content-Type': 'application/json' }) };
    if (body !== undefined) init.body = JSON.stringify(body);
    const r = await fetch(path, init);
    if (r.status === 401) {
      await askKey(key() ? 'That key was refused; enter another.' : '');
      continue;
    }
    const v = await r.json().catch(() => null);
    if (!r.ok) {
      const e = new Error((v && v.error && v.error.message) || r.statusText);
      e.status = r.status;
      e.code = v && v.error && v.error.code;
      throw e;
    }
    return v;
  }
}

/** Reads an SSE stream with fetch; reconnects with Last-Event-ID until `onEvent` returns false. */
function sse(path, onEvent) {
  const ctl = new AbortController();
  teardown.push(() => ctl.abort());
  let last = null;
  (async () => {
    let backoff = 500;
    while (!ctl.signal.aborted) {
      try {
        const hd = headers({ Accept: 'text/event-stream' });
        if (last != null) hd['Last-Event-ID'] = last;
        const r = await fetch(path, { headers: hd, signal: ctl.signal });
        if (r.status === 401) { await askKey('That key was refused; enter another.'); continue; }
        if (!r.ok) throw new Error(r.statusText);
        setLive(true);
        backoff = 500;
        const reader = r.body.getReader();
        const dec = new TextDecoder();
        let buf = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          let i;
          while ((i = buf.indexOf('\n\n')) >= 0) {
            const chunk = buf.slice(0, i);
            buf = buf.slice(i + 2);
            const ev = { event: 'message', data: '', id: null };
            for (const line of chunk.split('\n')) {
              if (!line || line.startsWith(':')) continue;
              const c = line.indexOf(':');
              const f = c < 0 ? line : line.slice(0, c);
              let v = c < 0 ? '' : line.slice(c + 1);
              if (v.startsWith(' ')) v = v.slice(1);
              if (f === 'event') ev.event = v;
              else if (f === 'data') ev.data += (ev.data ? '\n' : '') + v;
              else if (f === 'id') ev.id = v;
            }
            if (ev.id != null) last = ev.id;
            if (!ev.data) continue;
            let d;
            try { d = JSON.parse(ev.data); } catch (_) { d = ev.data; }
            if (onEvent(ev.event, d) === false) { setLive('up to date'); ctl.abort(); return; }
          }
        }
      } catch (e) {
        if (ctl.signal.aborted) return;
      }
      setLive(false);
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 10000);
    }
  })();
}

// ---------- routing: the URL is the state ----------
function go(href, replace) {
  if (replace) history.replaceState(null, '', href);
  else history.pushState(null, '', href);
  render();
}
document.addEventListener('click', (ev) => {
  const a = ev.target.closest('a');
  if (!a || a.target || ev.metaKey || ev.ctrlKey || ev.shiftKey) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin || !url.pathname.startsWith('/ui')) return;
  ev.preventDefault();
  go(url.pathname + url.search);
});
window.addEventListener('popstate', render);
document.getElementById('forget').onclick = () => { sessionStorage.removeItem(KEY); location.reload(); };
document.getElementById('forget').hidden = !key();

async function render() {
  for (const f of teardown) f();
  teardown = [];
  setLive(false);
  const path = location.pathname.replace(/\/+$/, '');
  const q = new URLSearchParams(location.search);
  let m;
  const nav = path === '/ui' || path === '' ? 'overview' : path.split('/')[2];
  for (const a of document.querySelectorAll('nav a')) a.classList.toggle('active', a.dataset.nav === nav);
  try {
    if (path === '/ui' || path === '') await overview();
    else if (path === '/ui/runs') await runs(q);
    else if ((m = path.match(/^\/ui\/runs\/([0-9a-f-]{36})$/))) await run(m[1]);
    else if ((m = path.match(/^\/ui\/threads\/([A-Za-z0-9_.:-]{1,200})$/))) await thread(decodeURIComponent(m[1]), q);
    else if (path === '/ui/agents') await agents();
    else if (path === '/ui/webhooks') await webhooks();
    else if (path === '/ui/schedules') await schedules();
    else put(main, h('h1', {}, 'Not found'), h('p', {}, link('/ui/', 'Back to the overview')));
  } catch (e) {
    put(main, h('h1', {}, e.status === 404 ? 'Not found' : 'Error'), h('p', { class: 'err', id: 'error' }, e.message));
  }
}

// ---------- charts (inline SVG) ----------
function chart(title, values, opts) {
  const o = Object.assign({ fmt: num, line: null, bad: null }, opts || {});
  const W = 300, H = 100, n = values.length || 1;
  const max = Math.max(1e-9, ...values, ...(o.line || []), ...(o.bad || []));
  const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  const bw = W / n;
  // One bar per minute; the failed share is drawn over the total in red.
  const bars = (list, cls) => list.forEach((v, i) => {
    if (!v) return;
    const r = document.createElementNS(svg.namespaceURI, 'rect');
    const hgt = (v / max) * (H - 4);
    r.setAttribute('x', i * bw + 0.5); r.setAttribute('y', H - hgt); r.setAttribute('width', Math.max(bw - 1, 1)); r.setAttribute('height', hgt);
    r.setAttribute('class', cls);
    svg.append(r);
  });
  bars(values, 'bar');
  bars(o.bad || [], 'bar bad');
  if (o.line) {
    const p = document.createElementNS(svg.namespaceURI, 'polyline');
    p.setAttribute('points', o.line.map((v, i) => `${i * bw + bw / 2},${H - ((v || 0) / max) * (H - 4)}`).join(' '));
    p.setAttribute('class', 'line2');
    svg.append(p);
  }
  const total = values.reduce((a, b) => a + (b || 0), 0);
  return h('div', { class: 'card chart' }, h('div', { class: 't' }, h('span', {}, title), h('span', {}, o.summary != null ? o.summary : o.fmt(total))), svg);
}

// ---------- views ----------
async function overview() {
  put(main, h('h1', {}, 'Overview'), h('div', { id: 'ov' }, h('p', { class: 'muted' }, 'Loading…')));
  const draw = (o) => {
    viewer = o.viewer || viewer;
    const box = document.getElementById('ov');
    if (!box) return false;
    const lat = o.minutes.map((m) => m.step_ms_p50 || 0);
    const p95 = o.minutes.map((m) => m.step_ms_p95 || 0);
    const withCalls = o.minutes.filter((m) => m.step_ms_p50 != null);
    const medianOfMinutes = withCalls.length ? withCalls.map((m) => m.step_ms_p50).sort((a, b) => a - b)[Math.floor(withCalls.length / 2)] : null;
    put(box, 
      h('div', { class: 'cards', id: 'counts' },
        STATES.map((s) => h('a', { class: 'card', href: '/ui/runs?status=' + s, 'data-count': s },
          h('div', { class: 'n' }, num(o.runs[s] || 0)), h('div', { class: 'l' }, s))),
        h('div', { class: 'card' }, h('div', { class: 'n', id: 'queue-depth' }, num(o.queue.depth)),
          h('div', { class: 'l' }, 'queued; oldest ' + (o.queue.oldest_age_s == null ? '—' : o.queue.oldest_age_s.toFixed(0) + ' s'))),
        h('div', { class: 'card' }, h('div', { class: 'n' }, usd(o.last_hour.cost_usd)), h('div', { class: 'l' }, num(o.last_hour.tokens) + ' tokens, last hour'))),
      h('div', { class: 'charts' },
        chart('Runs ended per minute (failed in red)', o.minutes.map((m) => m.runs_finished), { bad: o.minutes.map((m) => m.runs_failed) }),
        chart('Model calls per minute', o.minutes.map((m) => m.steps)),
        chart('Model-call latency p50 (bars) / p95 (line), ms', lat, { line: p95, summary: medianOfMinutes == null ? '—' : medianOfMinutes + ' ms' }),
        chart('Tokens per minute', o.minutes.map((m) => m.tokens)),
        chart('Cost per minute', o.minutes.map((m) => m.cost_usd), { fmt: usd })),
      o.sampled ? h('p', { class: 'muted' }, 'Busy hour: the charts are drawn from the newest 20,000 events.') : null,
      h('div', { class: 'grid2' },
        h('div', {}, h('h2', {}, 'Workers'),
          o.workers.length === 0 ? h('p', { class: 'muted' }, 'No worker has reported in the last day.') :
            h('div', { class: 'scroll' }, h('table', { id: 'workers' },
              h('tr', {}, h('th', {}, 'worker'), h('th', {}, 'heartbeat'), h('th', {}, 'runs now')),
              o.workers.map((w) => h('tr', {},
                h('td', { class: 'mono' }, w.name),
                h('td', {}, w.alive ? 'alive' : 'gone', h('span', { class: 'muted' }, ' · ' + when(w.last_seen))),
                h('td', {}, w.runs.length ? w.runs.map((r) => [link('/ui/runs/' + r, short(r), { class: 'mono' }), ' ']) : h('span', { class: 'muted' }, 'idle'))))))),
        h('div', {}, h('h2', {}, 'Failures, last 24 h'),
          Object.keys(o.failures_24h).length === 0 ? h('p', { class: 'muted' }, 'None.') :
            h('table', { id: 'failures' }, h('tr', {}, h('th', {}, 'error.kind'), h('th', {}, 'runs')),
              Object.entries(o.failures_24h).map(([k, n]) => h('tr', {}, h('td', {}, link('/ui/runs?status=failed&q=', k)), h('td', {}, num(n))))))),
      h('p', { class: 'muted' }, 'Updated ' + when(o.now)));
    return true;
  };
  draw(await api('GET', '/v1/overview'));
  sse('/v1/overview/stream', (ev, o) => (ev === 'overview' ? draw(o) : true));
}

// Who the key belongs to and whether it is an admin, from the overview (read once).
let viewer = null;
async function whoAmI() {
  if (!viewer) viewer = await api('GET', '/v1/overview').then((o) => o.viewer).catch(() => ({ owner: '', admin: false }));
  return viewer;
}

function filterForm(q, admin) {
  const field = (name, label, el) => h('label', {}, label, el);
  const input = (name, ph, type) => h('input', { name, value: q.get(name) || '', placeholder: ph || '', type: type || 'text', size: 14 });
  const status = h('select', { name: 'status' }, h('option', { value: '' }, 'any'), STATES.map((s) => h('option', { value: s, selected: q.get('status') === s }, s)));
  const order = h('select', { name: 'order' }, h('option', { value: 'newest' }, 'newest first'), h('option', { value: 'oldest', selected: q.get('order') === 'oldest' }, 'oldest first'));
  const form = h('form', { class: 'filters', id: 'filters' },
    field('status', 'status', status), field('agent', 'agent', input('agent')), field('q', 'text in input/result', input('q', 'text')),
    field('thread_id', 'thread', input('thread_id')), field('parent_run_id', 'parent run', input('parent_run_id')),
    field('since', 'since', input('since', '2026-12-01T00:00:00Z')), field('until', 'until', input('until')),
    admin ? field('owner', 'owner', input('owner', 'yours')) : null,
    field('order', 'order', order), h('button', { type: 'submit' }, 'Filter'), link('/ui/runs', 'clear'));
  form.onsubmit = (ev) => {
    ev.preventDefault();
    const p = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v && !(k === 'order' && v === 'newest')) p.set(k, v);
    go('/ui/runs' + (p.toString() ? '?' + p : ''));
  };
  return form;
}

async function runs(q) {
  const me = await whoAmI();
  // An admin looking at another owner's runs sees them; bulk actions stay with its own.
  const others = !!q.get('owner') && q.get('owner') !== me.owner;
  const params = new URLSearchParams(q);
  if (!params.get('limit')) params.set('limit', '50');
  const filterOnly = new URLSearchParams(q);
  filterOnly.delete('cursor');
  filterOnly.delete('limit');
  const page = await api('GET', '/v1/runs?' + params);
  const selected = new Set();
  const count = h('span', { class: 'muted', id: 'selected-count' }, '0 selected');
  const bulk = async (action, ids) => {
    const body = ids ? { action, run_ids: ids } : { action, filter: Object.fromEntries(filterOnly) };
    if (!ids && !confirm(`${action} every run matching this filter (up to 1,000)?`)) return;
    const r = await api('POST', '/v1/runs/bulk', body).catch((e) => { toast(e.message); return null; });
    if (r) {
      toast(`${action}: ${r.done.length} done, ${r.skipped.length} skipped` + (r.truncated ? ' (more match: repeat)' : ''));
      document.getElementById('bulk-result').textContent = `${action}: ${r.done.length} done, ${r.skipped.length} skipped`;
      await refresh();
    }
  };
  const table = h('tbody', { id: 'runs-body' });
  const rows = (list) => list.map((r) => {
    const cb = h('input', { type: 'checkbox', 'data-run': r.id, 'aria-label': 'select run ' + short(r.id) });
    cb.checked = selected.has(r.id);
    cb.onchange = () => { cb.checked ? selected.add(r.id) : selected.delete(r.id); count.textContent = selected.size + ' selected'; };
    return h('tr', { 'data-run': r.id },
      h('td', {}, others ? null : cb),
      h('td', {}, link('/ui/runs/' + r.id, short(r.id), { class: 'mono' })),
      h('td', {}, badge(r.status)),
      h('td', {}, r.agent),
      h('td', { class: 'hide-sm' }, link('/ui/threads/' + encodeURIComponent(r.thread_id), short(r.thread_id), { class: 'mono' })),
      h('td', { class: 'hide-sm' }, when(r.created_at)),
      h('td', {}, dur(r.started_at, r.finished_at)),
      h('td', { class: 'hide-sm' }, num(r.usage.steps)),
      h('td', { class: 'hide-sm' }, num(r.usage_tree.total_tokens)),
      h('td', {}, usd(r.usage_tree.cost_usd)),
      h('td', { class: 'hide-sm muted' }, r.error ? r.error.kind + ': ' + r.error.message.slice(0, 80) : (r.progress[r.progress.length - 1] || '')));
  });
  const refresh = async () => {
    const p = await api('GET', '/v1/runs?' + params);
    put(table, ...rows(p.runs));
  };
  table.append(...rows(page.runs));
  const all = h('input', { type: 'checkbox', 'aria-label': 'select all on this page', id: 'select-all' });
  all.onchange = () => {
    for (const cb of table.querySelectorAll('input[type=checkbox]')) { cb.checked = all.checked; all.checked ? selected.add(cb.dataset.run) : selected.delete(cb.dataset.run); }
    count.textContent = selected.size + ' selected';
  };
  const next = page.next_cursor ? (() => { const p = new URLSearchParams(q); p.set('cursor', page.next_cursor); return link('/ui/runs?' + p, 'Next page →', { id: 'next-page' }); })() : null;
  put(main, 
    h('h1', {}, others ? 'Runs of ' + q.get('owner') : 'Runs'), filterForm(q, me.admin),
    others ? null : h('div', { class: 'actions' }, count,
      h('button', { id: 'bulk-cancel', class: 'danger', onclick: () => bulk('cancel', [...selected]) , }, 'Cancel selected'),
      h('button', { id: 'bulk-retry', onclick: () => bulk('retry', [...selected]) }, 'Retry selected'),
      h('button', { id: 'bulk-cancel-all', class: 'danger', onclick: () => bulk('cancel', null) }, 'Cancel all matching'),
      h('button', { id: 'bulk-retry-all', onclick: () => bulk('retry', null) }, 'Retry all matching'),
      h('span', { id: 'bulk-result', class: 'muted' })),
    h('div', { class: 'scroll' }, h('table', { id: 'runs' },
      h('thead', {}, h('tr', {}, h('th', {}, others ? null : all), h('th', {}, 'run'), h('th', {}, 'status'), h('th', {}, 'agent'), h('th', { class: 'hide-sm' }, 'thread'),
        h('th', { class: 'hide-sm' }, 'created'), h('th', {}, 'took'), h('th', { class: 'hide-sm' }, 'steps'), h('th', { class: 'hide-sm' }, 'tokens (tree)'), h('th', {}, 'cost (tree)'), h('th', { class: 'hide-sm' }, 'latest'))),
      table)),
    page.runs.length === 0 ? h('p', { class: 'muted', id: 'no-runs' }, 'No run matches.') : null,
    h('p', {}, next));
  // Live: the overview stream says when counts move; then this page is read again.
  let lastCounts = null;
  sse('/v1/overview/stream', (ev, o) => {
    if (!document.getElementById('runs-body')) return false;
    const c = JSON.stringify(o.runs);
    if (lastCounts !== null && c !== lastCounts) refresh();
    lastCounts = c;
    return true;
  });
}

function eventRow(e) {
  const d = e.data || {};
  const li = (cls, kind, ...body) => h('li', { class: cls, 'data-type': e.type, 'data-seq': e.seq }, h('span', { class: 'when' }, new Date(e.created_at).toLocaleTimeString()), h('span', { class: 'k' }, kind), h('div', {}, body));
  switch (e.type) {
    case 'run.queued': return li('', 'queued', d.agent || '', d.parent_run_id ? [' · child of ', link('/ui/runs/' + d.parent_run_id, short(d.parent_run_id), { class: 'mono' })] : '');
    case 'run.started': return li('', 'started', `attempt ${d.attempt} on ${d.worker || '?'}`, d.crashes ? ` · after ${d.crashes} crash(es)` : '');
    case 'run.resumed': return li('', 'resumed', d.reason || '');
    case 'step.started': return li('step', 'step ' + d.step, d.forced ? 'final answer forced (a limit was reached)' : '');
    case 'model.completed': return li('', 'model', `${d.model || ''} · ${num(d.usage && d.usage.prompt_tokens)} in${d.usage && d.usage.cache_read_tokens ? ` (${num(d.usage.cache_read_tokens)} cached)` : ''} / ${num(d.usage && d.usage.completion_tokens)} out`,
      d.ms != null ? ` · ${d.ms} ms` : '', d.cost_usd != null ? ` · ${usd(d.cost_usd)}` : '', d.tool_calls && d.tool_calls.length ? ' → ' + d.tool_calls.join(', ') : ' → answer');
    case 'tool.started': return li('', 'tool ▶', h('code', {}, d.tool), d.arguments ? h('pre', { class: 'pre' }, d.arguments) : '');
    case 'tool.completed': return li('', d.ok ? 'tool ✓' : 'tool ✗', h('code', {}, d.tool), d.ms != null ? ` · ${d.ms} ms` : '', d.offloaded ? ' · offloaded to a file' : '', d.refused ? ' · refused (loop)' : '', h('pre', { class: 'pre' }, d.preview || ''));
    case 'run.succeeded': return li('end', 'succeeded', h('pre', { class: 'pre' }, d.result || ''));
    case 'run.failed': return li('end failed', 'failed', d.error ? `${d.error.kind}: ${d.error.message}` : '');
    case 'run.cancelled': return li('end failed', 'cancelled', '');
    case 'child.started': return li('', 'child ▶', link('/ui/runs/' + d.child_run_id, short(d.child_run_id), { class: 'mono' }), ' ', d.agent, d.detached ? ' (detached)' : '');
    case 'child.finished': return li('', 'child ■', link('/ui/runs/' + d.child_run_id, short(d.child_run_id), { class: 'mono' }), ' ', d.status || '');
    case 'context.compacted': return li('', 'compacted', `${num(d.tokens_before)} → ${num(d.tokens_after)} tokens`, d.reason ? ` (${d.reason})` : '');
    case 'approval.requested': return li('', 'approval?', h('code', {}, d.tool), ' ', d.reason || '');
    case 'approval.resolved': return li('', 'approval', d.decision || d.status || '', d.reason ? ' — ' + d.reason : '');
    case 'run.waiting': return li('', 'waiting', d.waiting_on || '');
    case 'message.received': return li('', 'message', `received (${num(d.chars)} characters)`);
    case 'message.delivered': return li('', 'message', `delivered to the model at step ${d.step}`);
    default: return li('', e.type, h('span', { class: 'muted mono' }, JSON.stringify(d).slice(0, 200)));
  }
}

async function tree(list, depth) {
  if (!list.length || depth > 3) return null;
  const kids = await Promise.all(list.slice(0, 50).map((id) => api('GET', '/v1/runs/' + id).catch(() => null)));
  const ul = h('ul', { class: 'tree', id: depth === 1 ? 'tree' : null });
  for (const c of kids.filter(Boolean)) {
    ul.append(h('li', { 'data-run': c.id }, link('/ui/runs/' + c.id, short(c.id), { class: 'mono' }), ' ', badge(c.status), ' ', c.agent,
      h('span', { class: 'muted' }, ` · ${num(c.usage.total_tokens)} tokens · ${usd(c.usage.cost_usd)}`), await tree(c.children, depth + 1)));
  }
  return ul;
}

async function run(id) {
  let r = await api('GET', '/v1/runs/' + id);
  // The agents' current versions: a run that pinned an older one says so.
  const current = await api('GET', '/v1/agents').then((l) => Object.fromEntries(l.agents.map((a) => [a.name, a.version]))).catch(() => ({}));
  const head = h('div', { id: 'run-head' });
  const kids = h('div', { id: 'children' });
  const approvals = h('div', { id: 'approvals' });
  const timeline = h('ol', { class: 'timeline', id: 'timeline' });
  const drawHead = () => {
    const terminal = TERMINAL.includes(r.status);
    const u = r.usage, t = r.usage_tree;
    // What the provider's prompt cache served: part of the prompt, billed at the cached rate.
    const cached = (x) => (x.cache_read_tokens ? ` (${num(x.cache_read_tokens)} from cache)` : '');
    put(head, 
      h('h1', {}, 'Run ', h('span', { class: 'mono' }, short(r.id)), ' ', badge(r.status)),
      h('div', { class: 'actions' },
        !terminal ? h('button', { id: 'cancel', class: 'danger', onclick: async () => {
          await api('POST', `/v1/runs/${r.id}/cancel`).catch((e) => toast(e.message));
          r = await api('GET', '/v1/runs/' + id); drawHead();
        } }, 'Cancel') : null,
        (r.status === 'failed' || r.status === 'cancelled') && !r.parent_run_id ? h('button', { id: 'retry', onclick: async () => {
          const n = await api('POST', `/v1/runs/${r.id}/retry`).catch((e) => { toast(e.message); return null; });
          if (n) go('/ui/runs/' + n.id);
        } }, 'Retry') : null),
      h('dl', { class: 'kv' },
        h('dt', {}, 'id'), h('dd', { class: 'mono' }, r.id),
        h('dt', {}, 'agent'), h('dd', {}, r.agent, r.agent_version ? h('span', { class: 'muted mono', id: 'agent-version' }, ' ' + r.agent_version) : '',
          r.agent_version && current[r.agent] !== r.agent_version ? h('span', { class: 'warn', id: 'agent-version-old', title: 'the run keeps the definition it started with' }, current[r.agent] ? ` (not the current version ${current[r.agent]})` : ' (its file is gone)') : ''),
        h('dt', {}, 'thread'), h('dd', {}, link('/ui/threads/' + encodeURIComponent(r.thread_id), r.thread_id, { class: 'mono', id: 'thread-link' })),
        r.parent_run_id ? [h('dt', {}, 'parent'), h('dd', {}, link('/ui/runs/' + r.parent_run_id, r.parent_run_id, { class: 'mono' }))] : null,
        r.retry_of ? [h('dt', {}, 'retry of'), h('dd', {}, link('/ui/runs/' + r.retry_of, r.retry_of, { class: 'mono' }))] : null,
        h('dt', {}, 'attempts'), h('dd', {}, r.attempts),
        h('dt', {}, 'priority'), h('dd', {}, r.priority),
        h('dt', {}, 'created'), h('dd', {}, when(r.created_at)),
        h('dt', {}, 'started'), h('dd', {}, when(r.started_at), r.started_at ? h('span', { class: 'muted' }, ' (queued ' + dur(r.created_at, r.started_at) + ')') : ''),
        h('dt', {}, 'finished'), h('dd', {}, when(r.finished_at), r.started_at ? h('span', { class: 'muted' }, ' (took ' + dur(r.started_at, r.finished_at) + ')') : ''),
        r.queue_position != null ? [h('dt', {}, 'queue position'), h('dd', {}, r.queue_position)] : null,
        h('dt', {}, 'usage'), h('dd', { id: 'usage' }, `${num(u.steps)} steps · ${num(u.total_tokens)} tokens${cached(u)} · ${usd(u.cost_usd)}`),
        h('dt', {}, 'with children'), h('dd', { id: 'usage-tree' }, `${num(t.steps)} steps · ${num(t.total_tokens)} tokens${cached(t)} · ${usd(t.cost_usd)}`),
        h('dt', {}, 'input'), h('dd', {}, h('pre', { class: 'pre' }, r.input_preview || '')),
        r.result != null ? [h('dt', {}, 'result'), h('dd', {}, h('pre', { class: 'pre', id: 'result' }, r.result))] : null,
        r.error ? [h('dt', {}, 'error'), h('dd', { class: 'err', id: 'run-error' }, `${r.error.kind}: ${r.error.message}`)] : null));
  };
  const drawApprovals = () => {
    put(approvals, ...(r.approvals || []).map((a) => h('div', { class: 'approval', 'data-approval': a.id },
      h('div', {}, h('b', {}, 'Approve '), h('code', {}, a.tool), '? ', h('span', { class: 'muted' }, a.reason)),
      h('pre', { class: 'pre' }, JSON.stringify(a.input, null, 2)),
      h('div', { class: 'actions' },
        h('button', { class: 'primary', 'data-answer': 'allow', onclick: () => answer(a.id, 'allow') }, 'Allow'),
        h('button', { class: 'danger', 'data-answer': 'deny', onclick: () => answer(a.id, 'deny') }, 'Deny')))));
  };
  const answer = async (aid, decision) => {
    await api('POST', '/v1/approvals/' + encodeURIComponent(aid), { decision, reason: 'answered in the dashboard' }).catch((e) => toast(e.message));
    r = await api('GET', '/v1/runs/' + id);
    drawHead(); drawApprovals();
  };
  let lastTree = null;
  const drawKids = async () => {
    const t = await tree(r.children, 1);
    // Unchanged: keep the nodes (a click in progress must not land on a replaced link).
    const html = t ? t.outerHTML : '';
    if (html === lastTree) return;
    lastTree = html;
    put(kids, ...(t ? [h('h2', {}, 'Children'), t] : []));
  };
  // A message for the run, delivered before its next model call (drawn once, so a redraw of
  // the head never loses what is being typed).
  const say = h('form', { id: 'say', class: 'say', onsubmit: async (ev) => {
    ev.preventDefault();
    const text = say.querySelector('textarea');
    if (!text.value.trim()) return;
    const sent = await api('POST', `/v1/runs/${r.id}/messages`, { content: text.value }).catch((e) => { toast(e.message); return null; });
    if (sent) { text.value = ''; toast('message sent: the run reads it before its next model call'); }
  } },
    h('textarea', { id: 'say-text', rows: 2, placeholder: 'Message this run: it reads it before its next model call' }),
    h('button', { id: 'say-send', class: 'primary', type: 'submit' }, 'Send'));
  const drawSay = () => { say.hidden = TERMINAL.includes(r.status); };
  drawHead(); drawApprovals(); drawSay(); await drawKids();
  // The text of the step in flight, as the model writes it (cleared when the step commits).
  const live = h('pre', { class: 'pre live', id: 'live-text', hidden: true });
  let liveStep = null;
  put(main, head, say, approvals, kids, live, h('h2', {}, 'Timeline'), timeline);
  let pending = null;
  const reread = () => {
    if (pending) return;
    pending = setTimeout(async () => {
      pending = null;
      r = await api('GET', '/v1/runs/' + id).catch(() => r);
      if (!document.getElementById('run-head')) return;
      drawHead(); drawApprovals(); drawSay(); await drawKids();
    }, 150);
  };
  sse(`/v1/runs/${id}/events?include=deltas`, (type, e) => {
    if (!document.getElementById('timeline')) return false;
    if (type === 'model.delta') {
      if (e.text == null) return true;
      if (liveStep !== e.step) { liveStep = e.step; live.textContent = ''; }
      live.textContent += e.text;
      live.hidden = false;
      return true;
    }
    if (type === 'model.completed' || type === 'step.completed') { live.hidden = true; live.textContent = ''; liveStep = null; }
    timeline.append(eventRow(e));
    if (['model.completed', 'child.started', 'child.finished', 'approval.requested', 'approval.resolved', 'run.waiting', 'run.resumed', 'run.started'].includes(e.type) || TERMINAL.includes(e.type.slice(4))) reread();
    if (e.type === 'run.succeeded' || e.type === 'run.failed' || e.type === 'run.cancelled') {
      // Children may still be ending; one more look at them shortly.
      setTimeout(reread, 1000);
      return false;
    }
    return true;
  });
}

function messageBox(m, threadId) {
  const msg = m.message;
  const body = [];
  if (msg.content) body.push(h('pre', { class: 'pre' }, typeof msg.content === 'string' ? msg.content : JSON.stringify(msg.content)));
  for (const c of msg.tool_calls || []) body.push(h('div', {}, '→ ', h('code', {}, c.function.name), h('pre', { class: 'pre' }, c.function.arguments)));
  // A new thread that shares this one's history up to here, to go on differently from it.
  const fork = threadId ? h('button', { class: 'fork', 'data-fork': m.id, title: 'A new thread with the history up to this message', onclick: async () => {
    const f = await api('POST', `/v1/threads/${encodeURIComponent(threadId)}/fork`, { at_message: m.id }).catch((e) => { toast(e.message); return null; });
    if (f) go('/ui/threads/' + encodeURIComponent(f.thread_id));
  } }, 'Fork from here') : null;
  return h('div', { class: 'msg', 'data-message': m.id },
    h('div', { class: 'role' }, msg.role, msg.tool_call_id ? ' · ' + msg.tool_call_id : '', ' · step ' + m.step + ' · run ', link('/ui/runs/' + m.run_id, short(m.run_id), { class: 'mono' }), ' ', fork), body);
}

async function thread(id, q) {
  const after = q.get('after') || '0';
  const t = await api('GET', `/v1/threads/${encodeURIComponent(id)}?after=${encodeURIComponent(after)}&limit=50`);
  const nextHref = `/ui/threads/${encodeURIComponent(id)}?after=${t.next_after}`;
  put(main, 
    h('h1', {}, 'Thread ', h('span', { class: 'mono' }, id)),
    t.forked_from ? h('p', { id: 'forked-from' }, 'Forked from ', link('/ui/threads/' + encodeURIComponent(t.forked_from.thread_id), t.forked_from.thread_id, { class: 'mono' }), ` at message ${t.forked_from.at_message}`) : null,
    t.forks.length ? h('p', { id: 'forks' }, 'Forks: ', t.forks.map((f) => [link('/ui/threads/' + encodeURIComponent(f.thread_id), f.thread_id, { class: 'mono' }), ` (at message ${f.at_message}) `])) : null,
    h('h2', {}, 'Runs'),
    h('div', { class: 'scroll' }, h('table', { id: 'thread-runs' }, h('tr', {}, h('th', {}, 'run'), h('th', {}, 'status'), h('th', {}, 'agent'), h('th', {}, 'created'), h('th', {}, 'cost')),
      t.runs.map((r) => h('tr', {}, h('td', {}, link('/ui/runs/' + r.id, short(r.id), { class: 'mono' })), h('td', {}, badge(r.status)), h('td', {}, r.agent), h('td', {}, when(r.created_at)), h('td', {}, usd(r.usage.cost_usd)))))),
    t.compactions.length ? h('p', { class: 'muted' }, `${t.compactions.length} compaction(s): older messages are summarised in the model's context; all are still listed here.`) : null,
    h('h2', {}, 'Messages'),
    h('div', { id: 'messages' }, t.messages.map((m) => messageBox(m, id))),
    h('p', {}, after !== '0' ? [link(`/ui/threads/${encodeURIComponent(id)}`, '← first page'), ' '] : null,
      t.messages.length === 50 ? link(nextHref, 'Next messages →', { id: 'next-messages' }) : h('span', { class: 'muted' }, 'End of the thread.')));
}

async function agents() {
  const v = await api('GET', '/v1/agents');
  put(main, h('h1', {}, 'Agents'),
    h('div', { class: 'scroll' }, h('table', { id: 'agents' },
      h('tr', {}, h('th', {}, 'agent'), h('th', {}, 'model'), h('th', {}, 'tools it gets'), h('th', { class: 'hide-sm' }, 'limits'), h('th', { class: 'hide-sm' }, 'delegates to')),
      v.agents.map((a) => h('tr', { 'data-agent': a.name },
        h('td', {}, h('b', {}, a.name), h('div', { class: 'muted' }, a.description)),
        h('td', { class: 'mono' }, a.effective_model),
        h('td', { class: 'mono' }, a.effective_tools.length ? a.effective_tools.join(', ') : '(none)'),
        h('td', { class: 'hide-sm' }, `${a.max_steps} steps, ${a.timeout_s} s`),
        h('td', { class: 'hide-sm' }, a.subagents.join(', ')))))));
}

async function schedules() {
  const v = await api('GET', '/v1/schedules');
  const act = (s, what) => async () => {
    await api('POST', `/v1/schedules/${encodeURIComponent(s.id)}/${what}`).catch((e) => toast(e.message));
    render();
  };
  put(main, h('h1', {}, 'Schedules'),
    v.schedules.length ? '' : h('p', { class: 'muted' }, 'No schedules. POST /v1/schedules or `subagents schedules add` creates one (see docs/schedules.md).'),
    h('div', { class: 'scroll' }, h('table', { id: 'schedules' },
      h('tr', {}, h('th', {}, 'schedule'), h('th', {}, 'agent'), h('th', {}, 'next'), h('th', { class: 'hide-sm' }, 'recent runs'), h('th', {}, '')),
      v.schedules.map((s) => h('tr', { 'data-schedule': s.id },
        h('td', {}, h('b', { class: 'mono' }, s.cron), ' ', h('span', { class: 'muted' }, s.timezone),
          h('div', { class: 'muted' }, `${s.overlap} · catch-up ${s.catch_up}` + (s.thread_id ? ` · thread ${s.thread_id}` : ' · new thread each time')),
          h('div', { class: 'muted' }, s.input.slice(0, 120))),
        h('td', { class: 'mono' }, s.agent),
        h('td', {}, s.paused ? h('span', { class: 'warn', 'data-paused': 'true' }, 'paused')
          : h('div', {}, s.next_fire_times.slice(0, 3).map((t) => h('div', { class: 'mono' }, when(t))))),
        h('td', { class: 'hide-sm' }, s.recent_runs.map((r) =>
          h('div', {}, link('/ui/runs/' + r.run_id, short(r.run_id)), ' ', badge(r.status), ' ', h('span', { class: 'muted' }, when(r.scheduled_for))))),
        h('td', {},
          h('button', { class: 'link', onclick: act(s, s.paused ? 'resume' : 'pause') }, s.paused ? 'Resume' : 'Pause'), ' ',
          h('button', { class: 'link', 'data-trigger': s.id, onclick: act(s, 'trigger') }, 'Run now')))))));
}

async function webhooks() {
  const v = await api('GET', '/v1/webhooks');
  const recent = await Promise.all(v.webhooks.map((w) =>
    api('GET', `/v1/webhooks/${encodeURIComponent(w.id)}/deliveries?limit=10`).catch(() => ({ deliveries: [] }))));
  put(main, h('h1', {}, 'Webhooks'),
    v.webhooks.length ? '' : h('p', { class: 'muted' }, 'No subscriptions. POST /v1/webhooks adds one (see docs/webhooks.md).'),
    h('div', { class: 'scroll' }, h('table', { id: 'webhooks' },
      h('tr', {}, h('th', {}, 'destination'), h('th', {}, 'events'), h('th', {}, 'state'), h('th', { class: 'hide-sm' }, 'latest deliveries')),
      v.webhooks.map((w, i) => h('tr', { 'data-webhook': w.id },
        h('td', {}, h('b', { class: 'mono' }, w.url), h('div', { class: 'muted' }, w.description || w.id)),
        h('td', { class: 'mono' }, w.events.join(', '), w.agents ? h('div', { class: 'muted' }, 'agents: ' + w.agents.join(', ')) : ''),
        h('td', {}, w.paused
          ? h('span', { class: 'warn', 'data-paused': 'true' }, 'paused: ' + (w.paused_reason || ''))
          : h('span', {}, 'active')),
        h('td', { class: 'hide-sm' }, recent[i].deliveries.map((d) =>
          h('div', { class: 'mono', title: d.last_error || d.last_body || '' },
            badge(d.status), ` ${d.event_type} · ${d.attempts} attempt${d.attempts === 1 ? '' : 's'}`,
            d.last_status ? ` · HTTP ${d.last_status}` : ''))))))));
}

render();
