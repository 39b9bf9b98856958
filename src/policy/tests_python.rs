//! The Python rules: imports, calls and uses of functions, attributes, in every form the
//! module's documentation lists, with the evasions it resolves.

use super::tests::{allowed, policy, refused, refused_by, EXAMPLE};

/// The first rule alone.
const NETWORK: &str = r#"
[[rule]]
name = "no-network"
message = "network access is not allowed here"
deny_imports = ["socket", "ssl", "http.client", "requests"]
"#;

#[test]
fn imports_in_every_form() {
    let p = policy(NETWORK);
    for code in [
        "import socket",
        "import socket.x",
        "import os, socket as s",
        "from socket import create_connection",
        "from socket.x import y",
        "from http import client",
        "import http.client",
        "def f():\n    import socket",
        "class C:\n    import ssl",
        "if True:\n    import socket",
        "try:\n    pass\nexcept Exception:\n    import socket",
        "with open('x') as f:\n    import socket",
        "async def f():\n    async with x:\n        import socket",
        "match x:\n    case [a, *_]:\n        import socket",
        "f = lambda: __import__('socket')",
        "__import__('socket')",
        "__import__(\"socket.x\")",
        "__import__('os', fromlist=['x']) and __import__('http', fromlist=['client'])",
        "import importlib\nimportlib.import_module('socket')",
        "import importlib as il\nil.import_module('requests')",
        "from importlib import import_module as im\nim('ssl')",
        "import builtins\nbuiltins.__import__('socket')",
        "getattr(__builtins__, '__import__')('socket')",
        "__builtins__.__import__('socket')",
        "__builtins__['__import__']('socket')",
        "globals()['__builtins__'].__import__('socket')",
        "exec('import socket')",
        "exec(\"imp\" \"ort socket\")",
        "eval(\"__import__('socket')\")",
        "eval('  __import__(\"socket\")')",
        "compile('import socket', '<x>', 'exec')",
        "compile(b'import socket', '<x>', 'exec')",
        "exec(f'import socket')",
        "exec('exec(\"import socket\")')",
        "import timeit\ntimeit.timeit('import socket')",
        "import runpy\nrunpy.run_module('socket')",
        "import http\nhttp.client.HTTPConnection('x')",
        "import sys\nsys.modules['socket'].socket()",
        "type X[T] = list[T]\nimport socket",
        "if (n := 3) > 2:\n    print(f'{n=}')\n    import socket",
    ] {
        let refusal = refused(&p, code);
        assert_eq!(refusal.rule, "no-network", "{code:?}: {refusal}");
    }
    let line = refused_by(
        &p,
        "x = 1\n\nexec('x = 2\\nimport socket')\n",
        "no-network",
        "exec",
    );
    assert_eq!(
        (line.line, line.what.as_str()),
        (3, "import of socket, in code run by exec")
    );
}

#[test]
fn imports_that_are_not_the_denied_module() {
    let p = policy(EXAMPLE);
    allowed(
        &p,
        "import socketserver\nimport sslx\nimport http\nfrom . import socket",
    );
    allowed(
        &p,
        "from .socket import x\nfrom .. import ssl as s\nimport os; os.getcwd()",
    );
    allowed(
        &p,
        "import pandas as pd\nimport numpy as np\npd.DataFrame(np.zeros(3))",
    );
    allowed(
        &p,
        "print(\"import socket\")\nx = 'socket'\n# import socket\n",
    );
    allowed(
        &p,
        "s = '''\nimport socket\n'''\nrequests_made = 3\nprint(requests_made)",
    );
    allowed(&p, "import importlib\nimportlib.import_module('.x', 'pkg')");
}

#[test]
fn dynamic_imports_are_refused_when_imports_are_denied() {
    let p = policy(NETWORK);
    for code in [
        "__import__('so' + 'cket')",
        "m = 'socket'\n__import__(m)",
        "import importlib\nimportlib.import_module(name)",
        "__import__(*args)",
        "exec_ = __import__\nexec_(x)",
    ] {
        let r = refused_by(&p, code, "no-network", "a dynamic import");
        assert_eq!(
            r.what,
            "a dynamic import (its module name is not a literal)"
        );
    }
    // Only where the rule denies imports.
    let calls = policy("[[rule]]\nname = \"c\"\ndeny_calls = [\"os.system\"]\n");
    allowed(&calls, "__import__('so' + 'cket')");
}

#[test]
fn calls_through_aliases() {
    let p = policy(EXAMPLE);
    for code in [
        "import os\nos.system('ls')",
        "import os as o\no.system('ls')",
        "from os import system as s\ns('ls')",
        "from os import *\nsystem('ls')",
        "import os\nos.execv('/bin/sh', [])",
        "from os import execvp\nexecvp('sh', [])",
        "import subprocess\nsubprocess.run(['ls'])",
        "import subprocess as sp\nsp.Popen('ls')",
        "from subprocess import *\ncheck_output('ls')",
        "eval('1 + 1')",
        "import builtins\nbuiltins.eval('1')",
        "import os\ngetattr(os, 'system')('ls')",
        "import os\nf = getattr(os, 'system')",
        "import os\ns = os.system\ns('ls')",
        "import os\na = os\nb = a\nb.system('ls')",
        "import os\n(s := os.system)('ls')",
        "import os\na, b = os.system, 1\na('ls')",
        "import os\nlist(map(os.system, ['ls']))",
        "import os\n[os.system][0]('ls')",
        "import os\n(os.system or print)('ls')",
        "os.system('ls')",
        "__import__('os').system('ls')",
        "import sys\nsys.modules['os'].system('ls')",
        "import os\nvars(os)['system']('ls')",
        "import os\nos.__dict__['system']('ls')",
        "vars()['eval']('1')",
        "from mymodule import eval\neval('1')",
        "try:\n    from nothing import eval\nexcept ImportError:\n    pass\neval('1')",
        "import os\nos.system.__call__('ls')",
    ] {
        refused_by(&p, code, "no-shell", "of ");
    }
    // In code in code too.
    for code in [
        "exec(\"import os; os.system('ls')\")",
        "%time __import__('os').system('ls')",
        "%env X={__import__('os').system('ls')}",
        "get_ipython().run_cell(\"import os as o\\no.system('ls')\")",
    ] {
        refused_by(&p, code, "no-shell", "call of os.system, in ");
    }
    let r = refused_by(
        &p,
        "import os as o\no.system('ls')",
        "no-shell",
        "call of os.system",
    );
    assert_eq!(r.line, 2);
}

#[test]
fn calls_that_are_not_denied() {
    let p = policy(EXAMPLE);
    allowed(
        &p,
        "import os\nos.getcwd()\nos.path.join('a', 'b')\nos.environ.get('X')",
    );
    allowed(
        &p,
        "import platform\nplatform.system()\nimport pandas as pd\npd.eval('1+1')",
    );
    allowed(
        &p,
        "df.eval('a + b')\nliteral_eval('1')\nimport ast\nast.literal_eval('1')",
    );
    allowed(&p, "system = 'linux'\nprint(system)\nsubprocess_count = 2");
    allowed(&p, "def f(eval_mode=True):\n    return eval_mode\nf()");
}

#[test]
fn attributes_and_getattr() {
    let p = policy(EXAMPLE);
    for code in [
        "().__class__.__bases__[0].__subclasses__()",
        "f.__globals__",
        "x = f.__globals__['os']",
        "getattr(object, '__subclasses__')()",
        "setattr(f, '__globals__', {})",
        "delattr(f, '__globals__')",
        "hasattr(f, '__globals__')",
        "object.__getattribute__(f, '__globals__')",
        "f.__getattribute__('__globals__')",
        "vars(f)['__globals__']",
        "f.__dict__['__globals__']",
        "import operator\noperator.attrgetter('__globals__.x')(f)",
        "getattr(f, f'__globals__')",
        "getattr(f, '__glob' 'als__')",
    ] {
        refused_by(&p, code, "no-shell", "attribute __");
    }
    // Computed names: only with deny_dynamic_attributes.
    allowed(
        &p,
        "getattr(f, '__glob' + 'als__')\nname = 'x'\ngetattr(f, name)",
    );
    allowed(
        &p,
        "getattr(f, 'real')\nsetattr(obj, 'x', 1)\nhasattr(obj, 'shape')",
    );
    let dynamic = policy("[[rule]]\nname = \"d\"\ndeny_dynamic_attributes = true\n");
    for code in [
        "getattr(f, '__glob' + 'als__')",
        "name = 'x'\ngetattr(f, name)",
        "setattr(f, n, 1)",
        "delattr(f, n)",
        "hasattr(f, n)",
        "getattr(__builtins__, '__imp' + 'ort__')('socket')",
        "object.__getattribute__(f, n)",
        "getattr(*args)",
    ] {
        refused_by(&dynamic, code, "d", "not a literal");
    }
    allowed(
        &dynamic,
        "getattr(f, 'x')\nsetattr(obj, 'y', 2)\nf.__globals__",
    );
}
