// kernel-broker's session browser: the search and filters above the session list, kept in
// the page's query string (a reload or a shared link keeps them; the hash names the open
// session), and the list's entries (a fork's names its parent and the step, as a link).
//
// The filters are GET /v1/recordings's parameters: q, state, front_door, has_errors, since,
// until (RFC 3339; the form's local date and time converted). The server checks them and
// answers 400 naming a bad one; the page shows that message.
'use strict';

KB.list = (function () {
  const { el, when, ago, clip, metadataParts, frontDoor } = KB;
  const FIELDS = ['q', 'state', 'front_door', 'has_errors', 'since', 'until'];
  const DEBOUNCE_MS = 300;

  // The filters in the address bar: {field: value} for those set.
  function fromURL() {
    const p = new URLSearchParams(location.search);
    const f = {};
    for (const k of FIELDS) {
      const v = p.get(k);
      if (v) f[k] = v;
    }
    return f;
  }

  // Writes the filters into the address bar (replacing the entry: typing is not history),
  // keeping other parameters and the hash.
  function toURL(f) {
    const p = new URLSearchParams(location.search);
    for (const k of FIELDS) {
      if (f[k]) p.set(k, f[k]); else p.delete(k);
    }
    const qs = p.toString();
    history.replaceState(null, '', location.pathname + (qs ? '?' + qs : '') + location.hash);
  }

  function path(f) {
    const p = new URLSearchParams();
    for (const k of FIELDS) if (f[k]) p.set(k, f[k]);
    const qs = p.toString();
    return 'v1/recordings' + (qs ? '?' + qs : '');
  }

  const active = (f) => FIELDS.some((k) => f[k]);

  // "2026-11-27T03:05" (the form's local time) <-> an RFC 3339 instant.
  function localToInstant(v) {
    if (!v) return '';
    const d = new Date(v);
    return isNaN(d) ? v : d.toISOString();
  }
  function instantToLocal(v) {
    const d = new Date(v || '');
    if (!v || isNaN(d)) return '';
    const pad = (n) => String(n).padStart(2, '0');
    return d.getFullYear() + '-' + pad(d.getMonth() + 1) + '-' + pad(d.getDate()) + 'T' + pad(d.getHours()) + ':' + pad(d.getMinutes());
  }

  // Wires the form in index.html: `changed(filters)` is called with the new filters after
  // typing stops, at once on Enter or on a select or date change.
  function bindForm(initial, changed) {
    const form = document.getElementById('search');
    const q = document.getElementById('q');
    const selects = { state: 'f-state', front_door: 'f-front-door', has_errors: 'f-has-errors' };
    const dates = { since: 'f-since', until: 'f-until' };
    q.value = initial.q || '';
    for (const [k, id] of Object.entries(selects)) {
      const s = document.getElementById(id);
      // A value from a link that is not an option is kept as one, so that the server
      // names it in its 400.
      if (initial[k] && ![...s.options].some((o) => o.value === initial[k])) s.append(el('option', { value: initial[k], text: initial[k] }));
      s.value = initial[k] || '';
    }
    const kept = {};
    for (const [k, id] of Object.entries(dates)) {
      const d = document.getElementById(id);
      d.value = instantToLocal(initial[k]);
      // Not a date the form can show: sent as it came (the server says what is wrong).
      if (initial[k] && !d.value) kept[k] = initial[k];
    }
    const read = () => {
      const f = {};
      if (q.value.trim()) f.q = q.value.trim();
      for (const [k, id] of Object.entries(selects)) {
        const v = document.getElementById(id).value;
        if (v) f[k] = v;
      }
      for (const [k, id] of Object.entries(dates)) {
        const v = document.getElementById(id).value;
        if (v) f[k] = localToInstant(v);
        else if (kept[k]) f[k] = kept[k];
      }
      return f;
    };
    let timer = null;
    const now = () => { clearTimeout(timer); changed(read()); };
    q.addEventListener('input', () => { clearTimeout(timer); timer = setTimeout(now, DEBOUNCE_MS); });
    form.addEventListener('submit', (e) => { e.preventDefault(); now(); });
    for (const id of Object.values(selects)) document.getElementById(id).addEventListener('change', now);
    for (const [k, id] of Object.entries(dates)) {
      document.getElementById(id).addEventListener('change', () => { delete kept[k]; now(); });
    }
    document.getElementById('f-clear').addEventListener('click', () => {
      form.reset();
      for (const k of Object.keys(kept)) delete kept[k];
      now();
    });
  }

  // Characters kept before the first match: the entry shows two lines of a snippet, and the
  // match must be on them.
  const LEAD = 30;

  // The snippet on one line (its whitespace collapsed), starting shortly before the first
  // match, with each occurrence of the search text marked (case-insensitive).
  function marked(snippet, q) {
    const out = el('span', { class: 'snippet' });
    let s = String(snippet || '').replace(/\s+/g, ' ');
    const needle = (q || '').replace(/\s+/g, ' ').toLowerCase();
    const first = needle ? s.toLowerCase().indexOf(needle) : -1;
    if (first > LEAD) s = '…' + s.slice(first - LEAD + 1);
    if (!needle) { out.append(s); return out; }
    const lower = s.toLowerCase();
    let at = 0;
    for (;;) {
      const i = lower.indexOf(needle, at);
      if (i < 0 || needle.length === 0) break;
      out.append(s.slice(at, i), el('mark', { text: s.slice(i, i + needle.length) }));
      at = i + needle.length;
    }
    out.append(s.slice(at));
    return out;
  }

  // One session of the list. `mem`: its memory line while live; `q`: the search text.
  function entry(r, opts) {
    const errors = typeof r.errors === 'number' ? r.errors : null;
    const meta = metadataParts(r.metadata);
    const last = r.last_event_at || r.ended_at || r.created_at;
    // Who ended it; a bare "closed" (a recording from before closes said who) says nothing more than the state.
    const ended = r.ended_by && r.ended_by !== 'closed' ? 'ended by ' + KB.events.by(r.ended_by) : '';
    const matches = Array.isArray(r.matches) ? r.matches.slice(0, 3) : [];
    // A fork: "forked from <parent> at step N", the parent a link to it.
    const fork = KB.forkNote(r.forked_from);
    return el('li', {
      class: 'session' + (opts.selected ? ' selected' : ''),
      'data-id': r.id,
      title: r.id,
      tabindex: 0,
      onclick: () => { location.hash = r.id; },
      onkeydown: (e) => { if (e.key === 'Enter') location.hash = r.id; },
    },
    el('div', { class: 'line head' },
      el('span', { class: 'state state-' + clip(r.state, 20), text: clip(r.state, 20) }),
      r.front_door ? el('span', { class: 'door door-' + clip(r.front_door, 20), text: frontDoor(r.front_door) }) : null,
      el('span', { class: 'last', text: ago(last), title: 'last activity ' + when(last) + '\ncreated ' + when(r.created_at) + (r.ended_at ? '\nended ' + when(r.ended_at) : '') })),
    meta.length ? el('div', { class: 'line meta', text: meta.join(' · '), title: clip(meta.join('\n'), 1000) }) : null,
    fork ? el('div', { class: 'line fork' }, fork) : null,
    el('div', { class: 'line facts' },
      el('code', { class: 'sid', text: r.id.slice(0, 8) }),
      el('span', { class: 'count', text: r.cells + (r.cells === 1 ? ' cell' : ' cells') }),
      errors === null ? null : el('span', { class: 'errors' + (errors > 0 ? ' some' : ''), text: errors + (errors === 1 ? ' error' : ' errors') }),
      ended ? el('span', { class: 'ended-by', text: ended }) : null),
    opts.mem ? el('div', { class: 'line mem', text: opts.mem }) : null,
    matches.length ? el('ul', { class: 'matches' }, ...matches.map((m) => el('li', { class: 'match', 'data-field': clip(m.field, 20) },
      el('span', { class: 'field', text: clip(m.field, 20) }), marked(clip(m.snippet, 400), opts.q)))) : null);
  }

  // What an empty list says.
  function empty(f) {
    return el('li', { class: 'empty', text: active(f) ? 'No sessions match this search and these filters.' : 'No recorded sessions yet.' });
  }

  return { fromURL, toURL, path, bindForm, entry, empty, active };
})();
