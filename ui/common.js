// kernel-broker's session browser: what every part of the page uses. Plain JavaScript, no
// build step; the page's scripts share the one object `KB` (common.js first, app.js last).
//
// Everything a user or a kernel sent (code, output, metadata, file names, command lines) is
// hostile: it reaches the page only through `el`'s text nodes and attributes, never as HTML.
'use strict';

window.KB = (function () {
  // An element with attributes (`text` sets its text, `on...` adds a listener) and children
  // (nodes, or strings as text nodes).
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? '' : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  // 14:03:07.123
  function clock(t) {
    if (!t) return '';
    const d = new Date(t);
    return d.toLocaleTimeString([], { hour12: false }) + '.' + String(d.getMilliseconds()).padStart(3, '0');
  }

  // The date and time, in the reader's zone.
  function when(t) {
    return t ? new Date(t).toLocaleString([], { hour12: false }) : '';
  }

  // "just now", "5 min ago", "3 h ago", "2 days ago" (a future instant, from clock skew: "just now").
  function ago(t, now) {
    if (!t) return '';
    const s = Math.max(0, ((now || Date.now()) - new Date(t).getTime()) / 1000);
    if (s < 45) return 'just now';
    if (s < 3600) return Math.round(s / 60) + ' min ago';
    if (s < 86400) return Math.round(s / 3600) + ' h ago';
    const days = Math.round(s / 86400);
    return days + (days === 1 ? ' day ago' : ' days ago');
  }

  function duration(ms) {
    if (ms === null || ms === undefined || isNaN(ms)) return '';
    if (ms < 1000) return ms.toFixed(ms < 10 ? 1 : 0) + ' ms';
    if (ms < 60000) return (ms / 1000).toFixed(2) + ' s';
    return Math.floor(ms / 60000) + ' min ' + Math.round((ms % 60000) / 1000) + ' s';
  }

  function bytes(n) {
    if (typeof n !== 'number' || !isFinite(n)) return '';
    if (n < 1024) return n + ' B';
    if (n < 1048576) return (n / 1024).toFixed(1) + ' KiB';
    return (n / 1048576).toFixed(1) + ' MiB';
  }

  // A value from a recording as a short string: anything not a string is shown as JSON.
  function str(v) {
    if (v === null || v === undefined) return '';
    return typeof v === 'string' ? v : JSON.stringify(v);
  }

  // At most `n` characters of `s`, with an ellipsis when cut.
  function clip(s, n) {
    s = str(s);
    return s.length > n ? s.slice(0, n - 1) + '…' : s;
  }

  const joinText = (v) => (Array.isArray(v) ? v.join('') : typeof v === 'string' ? v : JSON.stringify(v, null, 1));

  const stripAnsi = (s) => String(s).replace(/\u001b\[[0-9;?]*[ -/]*[@-~]/g, '').replace(/\u001b\][^\u0007]*(\u0007|\u001b\\)/g, '');

  // A session's metadata as short "key=value" parts, the MCP client's name first
  // ({client, client_version} becomes "client 1.2"). Values are strings from a client.
  function metadataParts(metadata) {
    if (!metadata || typeof metadata !== 'object' || Array.isArray(metadata)) return [];
    const parts = [];
    const rest = Object.entries(metadata);
    if (typeof metadata.client === 'string') {
      parts.push(clip(metadata.client + (metadata.client_version ? ' ' + str(metadata.client_version) : ''), 80));
    }
    for (const [k, v] of rest) {
      if (typeof metadata.client === 'string' && (k === 'client' || k === 'client_version')) continue;
      parts.push(clip(k, 40) + '=' + clip(v, 80));
    }
    return parts;
  }

  const FRONT_DOORS = { rest: 'REST', jupyter: 'Jupyter', e2b: 'E2B', mcp: 'MCP' };
  const frontDoor = (d) => (d ? FRONT_DOORS[d] || clip(d, 20) : '');

  // A fork's parent as recorded (`session_created.forked_from`, or a list row's
  // `forked_from`): {session, step, checkpoint}, or null when there is none or it is not an
  // object. Its strings are clipped and stay text.
  function forkedFrom(f) {
    if (!f || typeof f !== 'object' || Array.isArray(f) || typeof f.session !== 'string' || !f.session) return null;
    return { session: clip(f.session, 40), step: clip(str(f.execution_count), 20), checkpoint: f.checkpoint ? clip(str(f.checkpoint), 40) : '' };
  }

  // A link to session `id` (the page opens it: its hash), showing `text` (its id's start).
  // A click does not reach what holds it (a list entry opens its own session).
  function sessionLink(id, text) {
    return el('a', {
      class: 'session-link', href: '#' + encodeURIComponent(id), 'data-session': id, title: id,
      text: text || id.slice(0, 8), onclick: (e) => e.stopPropagation(),
    });
  }

  // "forked from <parent> at step N", the parent a link; null for a session that is no fork.
  function forkNote(f, cls) {
    const p = forkedFrom(f);
    if (!p) return null;
    return el('span', { class: cls || 'forked-from', 'data-parent': p.session, 'data-step': p.step, title: p.checkpoint ? 'from checkpoint ' + p.checkpoint : 'from the live kernel' },
      'forked from ', sessionLink(p.session), ' at step ' + p.step);
  }

  return { el, clock, when, ago, duration, bytes, str, clip, joinText, stripAnsi, metadataParts, frontDoor, FRONT_DOORS, forkedFrom, sessionLink, forkNote };
})();
