// kernel-broker's session browser: the page. Plain JavaScript, no build step (common.js,
// events.js, list.js and timeline.js come first and share `KB`).
//
// Reads GET /v1/recordings (the list, with the search and filters of list.js), GET
// /v1/sessions (live sessions' memory use and limit) and GET /v1/sessions/{id}/events (one
// session), rebuilds its cells from the recorded messages (timeline.js) the way the notebook
// export does, draws every other event (files, commands, network, closes) between them, and polls for new
// events every second while the session is live. Interrupt, Restart and Delete act on a live
// session through the REST API. "open live here" on a cell that has a live checkpoint (GET
// /v1/sessions/{id}/checkpoints lists it) forks a new session from that checkpoint and opens
// it. A fork names its parent (the list, the header, its `session_created`) and a parent its
// forks, as links. Every piece of kernel output is inserted as text; images only as data:
// URLs.
'use strict';

(function () {
  const TOKEN_KEY = 'kernel-broker-token';
  const LAB_KEY = 'kernel-broker-jupyterlab-url';
  const POLL_MS = 1000;
  const LIST_MS = 3000;

  // ---- login page ---------------------------------------------------------------------
  if (document.body.dataset.page === 'login') {
    const params = new URLSearchParams(location.search);
    const stored = sessionStorage.getItem(TOKEN_KEY);
    if (params.has('token')) {
      sessionStorage.removeItem(TOKEN_KEY);
      document.getElementById('login-message').textContent = 'That token was not accepted; try again.';
    } else if (stored) {
      params.set('token', stored);
      location.replace('./?' + params.toString() + location.hash);
      return;
    }
    // The form sends the token alone: keep the search, filters and session of the link it came from.
    const form = document.querySelector('form');
    form.action = './' + location.hash;
    for (const [k, v] of params) {
      if (k !== 'token') form.append(Object.assign(document.createElement('input'), { type: 'hidden', name: k, value: v }));
    }
    return;
  }

  // ---- token ----------------------------------------------------------------------------
  const params = new URLSearchParams(location.search);
  if (params.has('token')) {
    sessionStorage.setItem(TOKEN_KEY, params.get('token'));
    params.delete('token');
    const rest = params.toString();
    history.replaceState(null, '', location.pathname + (rest ? '?' + rest : '') + location.hash);
  }
  const token = sessionStorage.getItem(TOKEN_KEY) || '';

  // ---- helpers --------------------------------------------------------------------------
  const { el, clock, when, ago, duration, joinText, stripAnsi, metadataParts, frontDoor, sessionLink, forkNote } = KB;
  const EV = KB.events;

  function status(text, isError) {
    const s = document.getElementById('status');
    s.textContent = text || '';
    s.classList.toggle('error', !!isError);
  }

  class ApiError extends Error {}

  async function api(path, opts) {
    opts = opts || {};
    const r = await fetch('../' + path, {
      ...opts,
      headers: { ...(opts.headers || {}), Authorization: 'Bearer ' + token },
    });
    if (r.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      throw new ApiError('the token is no longer accepted: reload the page with ?token=…');
    }
    if (!r.ok) {
      let msg = r.status + ' ' + r.statusText;
      try {
        const body = await r.json();
        if (body && body.error) msg = body.error.message;
      } catch (_) { /* not JSON */ }
      throw new ApiError(msg);
    }
    return r;
  }

  const getJSON = async (path) => (await api(path)).json();

  // ---- the session list -------------------------------------------------------------------
  let recordings = [];
  // The caller's live sessions by id (GET /v1/sessions): their memory use and limit.
  let live = new Map();

  // "95 MiB of 256 MiB memory" for a live session; its limit alone while no kernel runs.
  function memoryText(s) {
    if (!s || s.memory_limit_bytes === undefined) return '';
    const mib = (b) => Math.round(b / 1048576) + ' MiB';
    const used = s.memory_used_bytes === null ? '' : mib(s.memory_used_bytes) + ' of ';
    return used + mib(s.memory_limit_bytes) + ' memory';
  }

  // The search and filters (list.js), from the address bar at first.
  let filters = KB.list.fromURL();
  // Answers to list requests can arrive out of order: only the newest request's is shown.
  let listRequest = 0;

  async function loadList() {
    const mine = ++listRequest;
    const f = filters;
    try {
      const [recs, sessions] = await Promise.all([getJSON(KB.list.path(f)), getJSON('v1/sessions')]);
      if (mine !== listRequest) return;
      if (!Array.isArray(recs)) throw new ApiError('GET /v1/recordings did not answer a list');
      recordings = recs;
      live = new Map(sessions.map((s) => [s.id, s]));
      renderList();
      if (current) { updateHeader(); loadCheckpoints(current); }
      if (listFailed) { listFailed = false; status(''); }
    } catch (e) {
      if (mine !== listRequest) return;
      listFailed = true;
      status(e.message, true);
      if (e instanceof ApiError && KB.list.active(f)) showListMessage('The search was refused: ' + e.message);
    }
  }
  let listFailed = false;

  function showListMessage(text) {
    recordings = [];
    drawn = '';
    document.getElementById('session-list').replaceChildren(el('li', { class: 'empty error-text', text }));
    document.getElementById('list-count').textContent = '';
  }

  // What the list last drew: polling redraws it only when something shown changed (the
  // relative times by the minute), so that focus and hover survive the poll.
  let drawn = '';

  function renderList() {
    const ul = document.getElementById('session-list');
    const mems = recordings.map((r) => memoryText(live.get(r.id)));
    const key = JSON.stringify([KB.list.path(filters), current && current.id, recordings, mems, Math.floor(Date.now() / 60000)]);
    if (key === drawn) return;
    drawn = key;
    // What this list answers (for a reader's tools and the tests: the search it shows).
    ul.dataset.query = KB.list.path(filters);
    ul.replaceChildren(...recordings.map((r, i) => KB.list.entry(r, {
      selected: current && current.id === r.id,
      mem: mems[i],
      q: filters.q,
    })));
    if (!recordings.length) ul.append(KB.list.empty(filters));
    document.getElementById('list-count').textContent = recordings.length ? '(' + recordings.length + ')' : '';
  }

  function search(f) {
    filters = f;
    KB.list.toURL(f);
    loadList();
  }

  // ---- one session --------------------------------------------------------------------------
  let current = null;

  function renderData(data) {
    const box = el('div', { class: 'data' });
    for (const mime of ['image/png', 'image/jpeg', 'image/gif']) {
      const v = data[mime];
      if (typeof v === 'string' && /^[A-Za-z0-9+/=\s]+$/.test(v)) {
        box.append(el('img', { class: 'output-image', alt: joinText(data['text/plain'] || mime), src: 'data:' + mime + ';base64,' + v.replace(/\s/g, '') }));
        return box;
      }
    }
    if (typeof data['image/svg+xml'] === 'string' || Array.isArray(data['image/svg+xml'])) {
      box.append(el('img', { class: 'output-image', alt: 'SVG image', src: 'data:image/svg+xml;charset=utf-8,' + encodeURIComponent(joinText(data['image/svg+xml'])) }));
      return box;
    }
    if (data['text/plain'] !== undefined) {
      box.append(el('pre', { class: 'text', text: joinText(data['text/plain']) }));
    } else {
      box.append(el('pre', { class: 'text muted', text: '[' + Object.keys(data).join(', ') + ']' }));
    }
    return box;
  }

  function renderCell(c) {
    const running = !c.done && !c.end;
    const st = c.status || (running ? 'running' : (c.replyStatus || ''));
    const dur = c.durationMs !== null ? c.durationMs
      : (c.end ? new Date(c.end) - new Date(c.start) : null);
    const outs = el('div', { class: 'outputs' });
    for (const o of c.outputs) {
      if (o.type === 'stream') outs.append(el('pre', { class: 'stream ' + o.name, text: o.text }));
      else if (o.type === 'error') {
        outs.append(el('div', { class: 'error' },
          el('div', { class: 'ename', text: o.ename + ': ' + o.evalue }),
          o.traceback.length ? el('pre', { class: 'traceback', text: stripAnsi(o.traceback.join('\n')) }) : null));
      } else {
        const d = renderData(o.data);
        d.classList.add(o.type);
        outs.append(d);
      }
    }
    if (c.note) outs.append(el('div', { class: 'error note' }, el('div', { class: 'ename', text: c.note.ename + ': ' + c.note.evalue })));
    const sec = el('section', { class: 'cell' + (running ? ' running' : ''), 'data-index': c.index, 'data-status': st, id: 'cell-' + c.index },
      el('header', {},
        el('span', { class: 'prompt', text: 'In [' + (c.count === null || c.count === undefined ? ' ' : c.count) + ']' }),
        el('span', { class: 'time', text: clock(c.start) }),
        el('span', { class: 'duration', text: running ? 'running…' : duration(dur) }),
        el('span', { class: 'badge status-' + st, text: st }),
        c.timedOut ? el('span', { class: 'badge status-timeout', text: 'timed out' }) : null,
        c.replay ? el('span', { class: 'badge replay ' + (c.replay.same_output ? 'same' : 'different'), text: c.replay.same_output ? 'replay: same' : 'replay: different' }) : null,
        openLiveButton(c)),
      el('pre', { class: 'code', text: c.code }),
      outs,
      c.replay && c.replay.diff ? el('details', { class: 'diff' }, el('summary', { text: 'replay diff (' + c.replay.status + ')' }), el('pre', { text: c.replay.diff })) : null);
    if (current && current.cursor === c.index) sec.classList.add('current');
    return sec;
  }

  // "open live here" on a cell whose checkpoint the session still holds (the session live
  // and the caller's: GET /v1/sessions lists it); disabled while a fork is asked for.
  function openLiveButton(c) {
    const s = current;
    if (!s || !c.checkpoint || s.model.ended || !live.has(s.id) || !s.checkpoints.has(c.checkpoint)) return null;
    return el('button', {
      type: 'button', class: 'open-live', 'data-checkpoint': c.checkpoint, disabled: s.forking,
      title: 'Fork a new live session from the checkpoint taken after this step (In [' + c.count + '])',
      onclick: () => openLive(c), text: 'open live here',
    });
  }

  function renderMarker(mk) {
    const x = EV.describe(mk.name, mk.detail);
    const links = Array.isArray(x.links) ? x.links : [];
    return el('div', { class: 'marker marker-' + mk.name + ' tone-' + x.tone, 'data-kind': mk.name },
      el('span', { class: 'time', text: clock(mk.time) }),
      el('span', { class: 'what', text: x.what }),
      ...x.detail.filter((t) => t).map((t) => el('span', { class: 'detail', text: t })),
      x.fork ? forkNote(x.fork, 'detail forked-from') : null,
      ...links.map((id) => el('span', { class: 'detail fork' }, sessionLink(id))));
  }

  // A command: its line and outcome, then what it printed (as the recording kept it).
  function renderCommand(cmd, ended) {
    const x = EV.command(cmd.start, cmd.end, ended);
    const end = cmd.end || {};
    const printed = ['stdout', 'stderr'].filter((k) => typeof end[k] === 'string' && end[k])
      .map((k) => el('pre', { class: 'command-output ' + k, text: end[k] }));
    return el('div', { class: 'marker command tone-' + x.tone + (x.running ? ' running' : ''), 'data-kind': 'command', 'data-pid': KB.str((cmd.start || end).pid) },
      el('span', { class: 'time', text: clock(cmd.time) }),
      el('span', { class: 'what', text: x.what }),
      el('code', { class: 'argv', text: x.line }),
      ...x.detail.filter((t) => t).map((t) => el('span', { class: 'detail', text: t })),
      ...printed);
  }

  // Allowed and closed network connections, folded: a summary line, the rest on demand.
  function renderEgress(g) {
    const allowed = g.lines.filter((l) => l.kind === 'egress_allowed').length;
    return el('details', { class: 'marker egress tone-quiet', 'data-kind': 'egress' },
      el('summary', {},
        el('span', { class: 'time', text: clock(g.time) }),
        el('span', { class: 'what', text: 'network' }),
        el('span', { class: 'detail', text: allowed + (allowed === 1 ? ' connection allowed' : ' connections allowed') + ', ' + (g.lines.length - allowed) + ' closed' })),
      el('ul', {}, ...g.lines.map((l) => el('li', {}, el('span', { class: 'time', text: clock(l.time) }), ' ', l.text))));
  }

  function renderEntry(entry, m) {
    if (entry.kind === 'cell') return renderCell(entry);
    if (entry.kind === 'command') return renderCommand(entry, m.ended);
    if (entry.kind === 'egress') return renderEgress(entry);
    return renderMarker(entry);
  }

  function renderDirty() {
    if (!current) return;
    const m = current.model;
    const timeline = current.timeline;
    const changed = m.dirty.size > 0;
    for (const entry of m.entries) {
      if (!m.dirty.has(entry)) continue;
      const node = renderEntry(entry, m);
      const old = current.nodes.get(entry);
      // A folded group keeps whether the reader opened it.
      if (old && old.tagName === 'DETAILS' && old.open) node.open = true;
      if (old) old.replaceWith(node); else timeline.append(node);
      current.nodes.set(entry, node);
    }
    m.dirty.clear();
    current.cellCount.textContent = m.cells.length + (m.cells.length === 1 ? ' cell' : ' cells');
    // Following a live session: keep its newest output in view.
    if (changed && current.follow.checked && !m.ended) {
      current.detail.scrollTop = current.detail.scrollHeight;
    }
    current.liveBadge.hidden = m.ended;
    if (m.created && !current.doorEl.textContent) {
      current.doorEl.textContent = frontDoor(m.created.front_door) ? 'via ' + frontDoor(m.created.front_door) : '';
      const meta = metadataParts(m.created.metadata);
      current.metaEl.textContent = meta.join(' · ');
      current.metaEl.title = KB.clip(meta.join('\n'), 1000);
    }
    if (m.created && !current.forkEl.firstChild) {
      const note = forkNote(m.created.forked_from);
      if (note) current.forkEl.append(note);
    }
    updateHeader();
  }

  // The open session's state: the live sessions' list says it while it lives; then the
  // recordings' list, or the recording's own end.
  function updateHeader() {
    if (!current) return;
    const s = live.get(current.id);
    const r = recordings.find((x) => x.id === current.id);
    const m = current.model;
    let state = s ? s.state : r ? r.state : m.endedKind === 'session_expired' ? 'expired' : m.ended ? 'closed' : current.stateEl.textContent;
    if (m.ended && s === undefined && (state === 'idle' || state === 'busy' || state === 'starting')) state = 'closed';
    current.stateEl.textContent = state;
    current.stateEl.className = 'state state-' + KB.clip(state, 20);
    current.memEl.textContent = memoryText(s);
    current.memEl.title = s && s.dead_reason ? s.dead_reason : '';
    // Actions only on a live session: one the broker still holds, whose recording has not ended.
    current.actions.hidden = !s || m.ended;
    // A paused session is resumed (any use would); a running one may be paused.
    const paused = state === 'paused';
    current.pauseBtn.hidden = paused;
    current.resumeBtn.hidden = !paused;
  }

  function move(delta) {
    if (!current || !current.model.cells.length) return;
    const n = current.model.cells.length;
    const prev = current.cursor;
    current.cursor = Math.max(0, Math.min(n - 1, (prev < 0 ? (delta > 0 ? -1 : n) : prev) + delta));
    const before = document.getElementById('cell-' + prev);
    if (before) before.classList.remove('current');
    const now = document.getElementById('cell-' + current.cursor);
    if (now) { now.classList.add('current'); now.scrollIntoView({ block: 'nearest' }); }
    current.position.textContent = 'cell ' + (current.cursor + 1) + ' of ' + n;
  }

  async function downloadNotebook() {
    try {
      const r = await api('v1/sessions/' + current.id + '/notebook');
      const blob = new Blob([await r.text()], { type: 'application/x-ipynb+json' });
      const a = el('a', { href: URL.createObjectURL(blob), download: 'session-' + current.id + '.ipynb' });
      document.body.append(a);
      a.click();
      a.remove();
    } catch (e) {
      status(e.message, true);
    }
  }

  // "Open in JupyterLab": the session's recording so far becomes a notebook in the Jupyter
  // server's root (PUT /api/contents), and a Jupyter session of that notebook is attached to
  // this session's kernel (POST /api/sessions {"kernel": {"id"}}): opening the notebook shows
  // the agent's cells and runs in its kernel, with its variables. The Jupyter server uses this
  // broker as its gateway (--gateway-url) and lets this page call it
  // (--ServerApp.allow_origin=<this origin>); the page's CSP allows loopback servers only.
  // scripts/open-in-jupyterlab does the same from a shell.
  async function openInJupyterLab() {
    const id = current.id;
    const given = current.labInput.value.trim();
    let lab;
    try {
      lab = new URL(given);
    } catch (e) {
      status('paste the URL `jupyter lab` printed (http://127.0.0.1:8889/lab?token=...)', true);
      return;
    }
    localStorage.setItem(LAB_KEY, given);
    const labToken = lab.searchParams.get('token') || '';
    const base = lab.origin + lab.pathname.replace(/\/(lab|tree)(\/.*)?$/, '').replace(/\/$/, '');
    const name = 'agent-session-' + id.slice(0, 8) + '.ipynb';
    const call = async (method, path, body) => {
      const r = await fetch(base + path, {
        method,
        headers: { Authorization: 'token ' + labToken, 'Content-Type': 'application/json' },
        body: JSON.stringify(body),
      });
      if (!r.ok) throw new Error('JupyterLab answered ' + r.status + ' to ' + method + ' ' + path);
      return r.json();
    };
    status('attaching session ' + id.slice(0, 8) + ' to JupyterLab…');
    try {
      const nb = await (await api('v1/sessions/' + id + '/notebook')).json();
      await call('PUT', '/api/contents/' + encodeURIComponent(name), { type: 'notebook', format: 'json', content: nb });
      const s = await call('POST', '/api/sessions', { path: name, name, type: 'notebook', kernel: { id } });
      if (s.kernel && s.kernel.id !== id) throw new Error(name + ' is open with another kernel in JupyterLab; close it there first');
      const url = base + '/lab/tree/' + encodeURIComponent(name) + (labToken ? '?token=' + encodeURIComponent(labToken) : '');
      current.labLink.href = url;
      current.labLink.hidden = false;
      status('attached: open ' + name + ' in JupyterLab');
      window.open(url, '_blank', 'noopener');
    } catch (e) {
      status('could not open in JupyterLab: ' + e.message + ' (is it started with --gateway-url and --ServerApp.allow_origin=' + location.origin + '?)', true);
    }
  }

  async function replay() {
    const id = current.id;
    status('replaying ' + current.model.cells.length + ' cells in a new session…');
    try {
      const r = await (await api('v1/sessions/' + id + '/replay', { method: 'POST' })).json();
      if (!current || current.id !== id) return;
      for (const cell of r.cells) {
        const c = current.model.cells[cell.index];
        if (c) { c.replay = cell; current.model.dirty.add(c); }
      }
      renderDirty();
      const same = r.cells.filter((c) => c.same_output).length;
      status('replayed in session ' + r.session.id.slice(0, 8) + ': ' + same + ' of ' + r.cells.length + ' cells gave the same output');
      loadList();
    } catch (e) {
      status('replay failed: ' + e.message, true);
    }
  }

  function stopFollowing() {
    if (current && current.timer) clearTimeout(current.timer);
  }

  async function poll(session) {
    if (current !== session) return;
    try {
      for (;;) {
        const page = await getJSON('v1/sessions/' + session.id + '/events?after=' + session.after + '&limit=1000');
        if (current !== session) return;
        let checkpointed = false;
        for (const ev of page.events) {
          KB.timeline.apply(session.model, ev);
          session.after = ev.seq;
          if (CHECKPOINT_EVENTS.has(ev.kind)) checkpointed = true;
        }
        if (checkpointed) loadCheckpoints(session);
        renderDirty();
        if (page.next_after === null) break;
      }
      session.loaded = true;
      session.detail.dataset.loaded = 'true';
    } catch (e) {
      status(e.message, true);
    }
    if (current === session && !session.model.ended) {
      session.timer = setTimeout(() => poll(session), POLL_MS);
    }
  }

  // Interrupt, Pause, Resume, Restart and Delete: the REST API with the page's token. The buttons wait for
  // the answer (disabled meanwhile); a failure is shown, never swallowed.
  async function act(what) {
    const session = current;
    const id = session.id;
    const short = id.slice(0, 8);
    const ask = {
      restart: 'Restart the kernel of session ' + short + '? Its variables are lost.',
      delete: 'Delete session ' + short + '? Its kernel is shut down (the recording is kept).',
    }[what];
    if (ask && !window.confirm(ask)) return;
    const req = {
      interrupt: ['v1/sessions/' + id + '/interrupt', 'POST', 'interrupt sent to session ' + short],
      pause: ['v1/sessions/' + id + '/pause', 'POST', 'session ' + short + ' paused to disk'],
      resume: ['v1/sessions/' + id + '/resume', 'POST', 'session ' + short + ' resumed'],
      restart: ['v1/sessions/' + id + '/restart', 'POST', 'session ' + short + ' restarted'],
      delete: ['v1/sessions/' + id, 'DELETE', 'session ' + short + ' deleted'],
    }[what];
    for (const b of session.actions.querySelectorAll('button')) b.disabled = true;
    session.actions.dataset.busy = what;
    status(what + '…');
    try {
      await api(req[0], { method: req[1] });
      status(req[2]);
      if (what === 'delete') live.delete(id);
    } catch (e) {
      status(what + ' failed: ' + e.message, true);
    } finally {
      for (const b of session.actions.querySelectorAll('button')) b.disabled = false;
      delete session.actions.dataset.busy;
      if (current === session) updateHeader();
      loadList();
    }
  }

  // Events after which the session's checkpoints are asked for again.
  const CHECKPOINT_EVENTS = new Set(['checkpoint_taken', 'checkpoint_dropped', 'session_rewound', 'kernel_restarted', 'session_closed', 'session_expired']);

  // The checkpoints the open session holds now (GET /v1/sessions/{id}/checkpoints), while it
  // is live and the caller's; the cells whose checkpoint came or went are drawn again.
  async function loadCheckpoints(session) {
    const ids = new Set();
    if (live.has(session.id) && !session.model.ended) {
      try {
        const r = await getJSON('v1/sessions/' + session.id + '/checkpoints');
        for (const cp of (r && Array.isArray(r.checkpoints) ? r.checkpoints : [])) {
          if (cp && typeof cp.id === 'string') ids.add(cp.id);
        }
      } catch (_) {
        // Ended, or one that cannot have checkpoints (409): none to offer. Not an error of the page's.
      }
    }
    if (current !== session) return;
    const before = session.checkpoints;
    session.checkpoints = ids;
    let changed = false;
    for (const c of session.model.cells) {
      if (c.checkpoint && before.has(c.checkpoint) !== ids.has(c.checkpoint)) { session.model.dirty.add(c); changed = true; }
    }
    if (changed) renderDirty();
  }

  // "open live here": a new session forked from the checkpoint taken after cell `c`
  // (POST /v1/sessions/{id}/checkpoints/{cp}/fork), then opened. Every such button and the
  // actions wait for the answer; a refusal (409, 429, 404) is shown and nothing is lost.
  async function openLive(c) {
    const session = current;
    const short = session.id.slice(0, 8);
    const setBusy = (busy) => {
      session.forking = busy;
      for (const b of session.detail.querySelectorAll('.open-live, .session-head .actions button')) b.disabled = busy;
      if (busy) session.detail.dataset.forking = 'true'; else delete session.detail.dataset.forking;
    };
    setBusy(true);
    status('opening a live session at step ' + c.count + ' of ' + short + '…');
    try {
      const r = await (await api('v1/sessions/' + session.id + '/checkpoints/' + encodeURIComponent(c.checkpoint) + '/fork', { method: 'POST' })).json();
      const made = r && Array.isArray(r.sessions) ? r.sessions[0] : null;
      if (!made || typeof made.id !== 'string') throw new ApiError('the fork did not answer a session');
      live.set(made.id, made);
      status('session ' + made.id.slice(0, 8) + ' forked from ' + short + ' at step ' + c.count);
      if (current === session) setBusy(false);
      location.hash = made.id;
      loadList();
    } catch (e) {
      status('open live here failed: ' + e.message, true);
      if (current === session) setBusy(false);
      loadCheckpoints(session);
    }
  }

  function open(id) {
    stopFollowing();
    const detail = document.getElementById('detail');
    const r = recordings.find((x) => x.id === id) || { id, state: '', kernel: '', created_at: null };
    const session = {
      id, after: 0, model: KB.timeline.newModel(), nodes: new Map(), cursor: -1, timer: null, detail,
      checkpoints: new Set(), forking: false,
    };
    current = session;
    session.stateEl = el('span', { class: 'state state-' + KB.clip(r.state, 20), text: r.state });
    session.doorEl = el('span', { class: 'door', text: r.front_door ? 'via ' + frontDoor(r.front_door) : '' });
    session.metaEl = el('span', { class: 'meta', text: metadataParts(r.metadata).join(' · ') });
    session.forkEl = el('span', { class: 'fork' });
    if (r.forked_from) { const note = forkNote(r.forked_from); if (note) session.forkEl.append(note); }
    session.cellCount = el('span', { class: 'count' });
    session.memEl = el('span', { class: 'mem', text: memoryText(live.get(id)) });
    session.position = el('span', { class: 'position' });
    session.follow = el('input', { type: 'checkbox', checked: true, id: 'follow' });
    session.liveBadge = el('span', { class: 'live', text: '● live' });
    session.timeline = el('div', { id: 'timeline' });
    session.labInput = el('input', {
      type: 'url', id: 'jupyterlab-url', value: localStorage.getItem(LAB_KEY) || '',
      placeholder: 'JupyterLab URL with ?token=', title: 'The URL `jupyter lab` printed, with its token',
    });
    session.labLink = el('a', { id: 'jupyterlab-link', target: '_blank', rel: 'noopener', hidden: true, text: 'notebook ↗', title: 'The notebook in JupyterLab' });
    session.pauseBtn = el('button', { type: 'button', id: 'action-pause', title: 'Pause the session to disk: its kernel ends, its state is kept and comes back on its next use', onclick: () => act('pause'), text: 'Pause' });
    session.resumeBtn = el('button', { type: 'button', id: 'action-resume', title: 'Bring the paused kernel back with its state', onclick: () => act('resume'), text: 'Resume', hidden: true });
    session.snapshots = KB.snapshots.panel(id, api, status, (made) => {
      live.set(made.id, made);
      location.hash = made.id;
      loadList();
    }, () => [...session.actions.querySelectorAll('button')]);
    session.actions = el('div', { class: 'actions', hidden: true },
      el('button', { type: 'button', id: 'action-interrupt', title: 'Interrupt the running execution', onclick: () => act('interrupt'), text: 'Interrupt' }),
      session.pauseBtn, session.resumeBtn,
      el('button', { type: 'button', id: 'action-snapshot', title: 'Take a snapshot: a named copy of the session\'s state that new sessions start from (it runs on)', onclick: () => session.snapshots.take(), text: 'Snapshot' }),
      el('button', { type: 'button', id: 'action-restart', title: 'Restart the kernel (its state is lost)', onclick: () => act('restart'), text: 'Restart' }),
      el('button', { type: 'button', id: 'action-delete', class: 'danger', title: 'End the session', onclick: () => act('delete'), text: 'Delete' }));
    detail.dataset.loaded = 'false';
    detail.dataset.session = id;
    detail.replaceChildren(
      el('div', { class: 'session-head' },
        el('div', { class: 'title-row' },
          el('h2', {}, 'Session ', el('code', { text: id })),
          session.actions),
        el('div', { class: 'facts' },
          session.stateEl, session.liveBadge, session.doorEl, session.forkEl,
          el('span', { text: r.kernel || '' }),
          el('span', { class: 'created', text: r.created_at ? 'created ' + when(r.created_at) : '' }),
          session.cellCount, session.memEl, session.metaEl),
        session.snapshots.el),
      el('div', { class: 'toolbar' },
        el('button', { type: 'button', title: 'Previous cell (k)', onclick: () => move(-1), text: '◀' }),
        el('button', { type: 'button', title: 'Next cell (j)', onclick: () => move(1), text: '▶' }),
        session.position,
        el('label', { class: 'follow' }, session.follow, ' follow'),
        el('button', { type: 'button', onclick: downloadNotebook, text: 'Download .ipynb' }),
        el('button', { type: 'button', onclick: replay, title: 'Replay in a new session', text: 'Replay' }),
        session.labInput,
        el('button', { type: 'button', id: 'open-in-jupyterlab', onclick: openInJupyterLab, text: 'Open in JupyterLab' }),
        session.labLink),
      session.timeline);
    renderList();
    updateHeader();
    poll(session);
    loadCheckpoints(session);
    session.snapshots.refresh();
  }

  function route() {
    const id = decodeURIComponent(location.hash.replace(/^#/, ''));
    if (id) open(id);
  }

  document.getElementById('forget').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.replace('./');
  });
  document.addEventListener('keydown', (e) => {
    if (e.target instanceof HTMLInputElement || e.target instanceof HTMLTextAreaElement) return;
    if (e.key === 'j') move(1);
    if (e.key === 'k') move(-1);
  });
  window.addEventListener('hashchange', route);

  KB.list.bindForm(filters, search);
  loadList().then(route);
  setInterval(loadList, LIST_MS);
})();
