// kernel-broker's session browser: a session's recorded events as a timeline, the page's
// counterpart of src/recording/notebook/timeline.rs. `newModel()` starts one; `apply(m, ev)`
// takes the next event (in order) and marks what changed in `m.dirty` for the page to draw.
//
// A cell starts at a non-silent `execute_request` to the kernel or at an agent's
// `execution_started`, and the kernel's messages whose parent is its request fill it. Every
// other broker event is an entry of its own (events.js describes it), except that a
// command's start and end are one entry (matched by pid) and allowed or closed network
// connections fold into a group with their neighbours. A `checkpoint_taken` names its
// checkpoint on the newest cell of that execution count (`c.checkpoint`): the cell the
// checkpoint holds the state after, where the page offers "open live here".
'use strict';

KB.timeline = (function () {
  const EV = KB.events;

  function newModel() {
    return {
      entries: [], byMsg: new Map(), cells: [], dirty: new Set(), ended: false, endedBy: null,
      clearPending: new Set(), commands: new Map(), created: null,
    };
  }

  function ensureCell(m, msgId, code, time) {
    let c = m.byMsg.get(msgId);
    if (c) return c;
    c = {
      kind: 'cell', index: m.cells.length, msgId, code: code || '', start: time, end: null,
      count: null, outputs: [], status: null, durationMs: null, timedOut: false, done: false,
      note: null, replay: null, checkpoint: null,
    };
    m.byMsg.set(msgId, c);
    m.cells.push(c);
    m.entries.push(c);
    m.dirty.add(c);
    return c;
  }

  function push(m, entry) {
    m.entries.push(entry);
    m.dirty.add(entry);
    return entry;
  }

  // A broker event that is not an execution's: a command (its start and end become one
  // entry, matched by pid), a network connection allowed or closed (folded into a group with
  // its neighbours), or a line of its own.
  function addEvent(m, ev) {
    const d = ev.detail && typeof ev.detail === 'object' ? ev.detail : {};
    if (ev.kind === 'command_started') {
      const cmd = push(m, { kind: 'command', time: ev.time, start: d, end: null });
      m.commands.set(String(d.pid), cmd);
      return;
    }
    if (ev.kind === 'command_ended') {
      const cmd = m.commands.get(String(d.pid));
      m.commands.delete(String(d.pid));
      if (cmd) { cmd.end = d; m.dirty.add(cmd); } else push(m, { kind: 'command', time: ev.time, start: null, end: d });
      return;
    }
    if (EV.FOLDED.has(ev.kind)) {
      const last = m.entries[m.entries.length - 1];
      const line = { time: ev.time, kind: ev.kind, text: EV.egressLine(ev.kind, d) };
      if (last && last.kind === 'egress') { last.lines.push(line); m.dirty.add(last); } else push(m, { kind: 'egress', time: ev.time, lines: [line] });
      return;
    }
    if (ev.kind === 'session_created') m.created = d;
    if (ev.kind === 'checkpoint_taken' && typeof d.checkpoint === 'string') {
      // The newest cell of that count: after a rewind, counts repeat, and the checkpoint is
      // of the cells run since.
      for (let i = m.cells.length - 1; i >= 0; i--) {
        const c = m.cells[i];
        if (c.count !== null && c.count !== undefined && c.count === d.execution_count) {
          c.checkpoint = d.checkpoint;
          m.dirty.add(c);
          break;
        }
      }
    }
    if (ev.kind === 'session_closed') m.endedBy = d.by || null;
    push(m, { kind: 'marker', name: ev.kind, time: ev.time, detail: d });
  }

  function pushOutput(c, o) {
    const last = c.outputs[c.outputs.length - 1];
    if (o.type === 'stream' && last && last.type === 'stream' && last.name === o.name) {
      last.text += o.text;
    } else {
      c.outputs.push(o);
    }
  }

  function apply(m, ev) {
    if (ev.direction === 'broker') {
      const d = ev.detail || {};
      if (ev.kind === 'execution_started') {
        const c = ensureCell(m, d.msg_id, d.code, ev.time);
        c.timeout = d.timeout_seconds;
        return;
      }
      if (ev.kind === 'execution_done') {
        const c = m.byMsg.get(d.msg_id);
        const x = d.execution;
        if (c && x) {
          c.status = x.status;
          c.durationMs = x.duration_ms;
          c.end = ev.time;
          c.done = true;
          if (x.execution_count !== null && x.execution_count !== undefined) c.count = x.execution_count;
          // The broker's own word (a timeout, a death) when the kernel's error does not say it.
          if (x.status !== 'ok' && x.error && !c.outputs.some((o) => o.type === 'error' && o.ename === x.error.ename)) c.note = x.error;
          m.dirty.add(c);
        }
        return;
      }
      if (ev.kind === 'execution_timeout') {
        const c = m.byMsg.get(d.msg_id);
        if (c) { c.timedOut = true; m.dirty.add(c); }
      }
      addEvent(m, ev);
      if (EV.ENDED.has(ev.kind)) {
        m.ended = true;
        m.endedKind = ev.kind;
        // Commands still without an end now never get one: they were cut off.
        for (const cmd of m.commands.values()) m.dirty.add(cmd);
      }
      return;
    }
    const content = ev.content || {};
    if (ev.direction === 'to_kernel') {
      if (ev.channel === 'shell' && ev.msg_type === 'execute_request' && !content.silent) {
        ensureCell(m, ev.msg_id, content.code, ev.time);
      }
      return;
    }
    const c = ev.parent_msg_id && m.byMsg.get(ev.parent_msg_id);
    if (!c) return;
    m.dirty.add(c);
    if (ev.channel === 'shell' && ev.msg_type === 'execute_reply') {
      if (content.execution_count !== undefined) c.count = content.execution_count;
      c.replyStatus = content.status;
      if (!c.end) c.end = ev.time;
      return;
    }
    if (ev.channel !== 'iopub') return;
    switch (ev.msg_type) {
      case 'execute_input':
        c.count = content.execution_count;
        c.inputAt = ev.time;
        return;
      case 'status':
        if (content.execution_state === 'idle' && c.replyStatus && !c.status) c.status = c.replyStatus;
        return;
      case 'clear_output':
        if (content.wait) m.clearPending.add(c); else c.outputs = [];
        return;
      case 'stream':
      case 'display_data':
      case 'execute_result':
      case 'error':
        if (m.clearPending.delete(c)) c.outputs = [];
        if (ev.msg_type === 'stream') pushOutput(c, { type: 'stream', name: content.name === 'stderr' ? 'stderr' : 'stdout', text: content.text || '' });
        else if (ev.msg_type === 'error') pushOutput(c, { type: 'error', ename: content.ename, evalue: content.evalue, traceback: content.traceback || [] });
        else pushOutput(c, { type: ev.msg_type === 'execute_result' ? 'result' : 'display', data: content.data || {} });
        return;
      default:
    }
  }

  return { newModel, apply };
})();
