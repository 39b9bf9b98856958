//! [`McpServer`]: the handler of one MCP session (rmcp makes one per `initialize`). It
//! declares the tools (their JSON schemas come from the argument types through `schemars`)
//! and the resources, finds the caller and the broker's state in each request, and holds
//! the broker session that calls without `session_id` use: created on first use, deleted
//! when the MCP session ends (its recording stays).

use std::borrow::Cow;
use std::sync::Arc;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, ListResourcesResult,
    PaginatedRequestParams, ProtocolVersion, ReadResourceRequestParams, ReadResourceResponse,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{tool, tool_handler, tool_router, ErrorData, RoleServer, ServerHandler};

use super::args::{
    CreateSessionArgs, DeleteSessionArgs, DeleteSnapshotArgs, ForkSessionArgs, ReadFileArgs,
    RewindArgs, RunCodeArgs, RunPythonArgs, SessionArgs, SnapshotArgs, UploadFileArgs,
};
use super::call::{Call, OwnSession};

/// What the server tells a model about itself at `initialize`.
const INSTRUCTIONS: &str = "Runs Python in persistent, sandboxed Jupyter (IPython) kernels, \
and other languages (R, JavaScript/TypeScript, bash, Java, SQL over the workspace's files) \
with run_code. State (variables, imports, files) persists across calls of the same session. \
Without session_id, calls use this connection's own session, created on first use. \
Files live in the user's workspace (the kernel's working directory, /workspace): upload with \
upload_file, read with read_file or list_files. Charts from matplotlib come back as PNG \
images. The session's notebook (.ipynb) is a resource.";

/// The handler of one MCP session.
#[derive(Clone)]
pub struct McpServer {
    tool_router: ToolRouter<Self>,
    pub(super) own: Arc<OwnSession>,
}

impl McpServer {
    pub fn new() -> Self {
        Self {
            tool_router: Self::tool_router(),
            own: Arc::default(),
        }
    }
}

impl Default for McpServer {
    fn default() -> Self {
        Self::new()
    }
}

#[tool_router]
impl McpServer {
    #[tool(
        description = "Run Python code in a persistent IPython kernel and return what it printed, its result, and any charts (PNG images). Variables, imports and files persist across calls of the same session. On an exception the result is an error carrying the exception's type, message and traceback: fix the code and call again. Long runs stream their output as progress notifications when the client asks for progress.",
        annotations(
            title = "Run Python",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn run_python(
        &self,
        Parameters(args): Parameters<RunPythonArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.run_python_call(Call::of(context)?, args).await
    }

    #[tool(
        name = "run_code",
        description = RUN_CODE,
        annotations(
            title = "Run code",
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn run_code(
        &self,
        Parameters(args): Parameters<RunCodeArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.run_code_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Write a file into the workspace (the kernel's working directory), e.g. a CSV to analyse. The content is base64; directories are created; an existing file is replaced.",
        annotations(
            title = "Upload a file",
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn upload_file(
        &self,
        Parameters(args): Parameters<UploadFileArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.upload_file_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Read a file of the workspace: text comes back as text, PNG/JPEG/GIF/WebP images as images, anything else as a base64 blob.",
        annotations(title = "Read a file", read_only_hint = true, open_world_hint = false)
    )]
    async fn read_file(
        &self,
        Parameters(args): Parameters<ReadFileArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.read_file_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "List the files of the workspace (path, size in bytes, last modified), as JSON.",
        annotations(title = "List files", read_only_hint = true, open_world_hint = false)
    )]
    async fn list_files(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.list_files_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Restart the session's kernel: every variable and import is lost (workspace files stay). Use it when the kernel is stuck or its state is beyond repair.",
        annotations(
            title = "Restart the kernel",
            destructive_hint = true,
            open_world_hint = false
        )
    )]
    async fn restart_session(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.restart_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Interrupt the code running in the session (like Ctrl-C: a KeyboardInterrupt); the kernel's state is kept.",
        annotations(title = "Interrupt", destructive_hint = false, open_world_hint = false)
    )]
    async fn interrupt_session(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.interrupt_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "List your sessions (id, state, kernel, executions, last activity) as JSON; the one this connection made is marked.",
        annotations(
            title = "List sessions",
            read_only_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_sessions(
        &self,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.list_sessions_call(Call::of(context)?).await
    }

    #[tool(
        description = "Create another session (a separate kernel with its own state) and return its id; pass it as session_id to the other tools to hold several at once.",
        annotations(
            title = "Create a session",
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn create_session(
        &self,
        Parameters(args): Parameters<CreateSessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.create_session_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Shut a session down (its kernel and state are gone; its recording stays).",
        annotations(
            title = "Delete a session",
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn delete_session(
        &self,
        Parameters(args): Parameters<DeleteSessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.delete_session_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Fork a session: make new sessions (count, default 1, at most 8) whose kernels hold everything the session's kernel holds now (variables, functions, imports, open files, random state, execution count), or held at a checkpoint (checkpoint_id). The original goes on untouched. Answers the new sessions as JSON: pass a fork's id as session_id to the other tools to try something there without disturbing the original. The session must be idle.",
        annotations(
            title = "Fork a session",
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn fork_session(
        &self,
        Parameters(args): Parameters<ForkSessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.fork_session_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Take a checkpoint of a session: a frozen copy of its kernel's state as it is now (variables, imports, random state, execution count), to go back to with rewind or start a fork from with fork_session. Answers the checkpoint (its id) as JSON. Workspace files are not part of it. The session must be idle; your oldest checkpoint is dropped past your count or memory budget.",
        annotations(
            title = "Take a checkpoint",
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn checkpoint(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.checkpoint_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "List a session's checkpoints (id, execution count, time, memory), your checkpoint budget, and the checkpoints dropped, as JSON.",
        annotations(
            title = "List checkpoints",
            read_only_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_checkpoints(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.list_checkpoints_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Rewind a session to a checkpoint: its kernel's variables, imports, random state and execution count become the checkpoint's again (what ran since is undone in memory; workspace files are not rewound). The checkpoint stays, so you can rewind to it again. The session must be idle.",
        annotations(
            title = "Rewind a session",
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn rewind(
        &self,
        Parameters(args): Parameters<RewindArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.rewind_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Pause a session to disk: its kernel's whole state (variables, imports, open files, generators, the execution count) is written to the broker's disk and the kernel ends, so it holds no memory. Any later use of the session (run_python, a fork, a checkpoint) or resume_session brings it back as it was. Answers the paused session (its image's size) as JSON. The session must be idle (and, sharing its workspace with your other sessions, hold no file open in its own /tmp).",
        annotations(
            title = "Pause a session",
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn pause_session(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.pause_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Snapshot a session: a named, persistent copy of its state (variables, imports, open files, the execution count, and a copy of its files) that new sessions start from (create_session with `snapshot`), each with its own copy. The session goes on as it was. Answers the snapshot (its id, name, size) as JSON. The session must be idle and have a workspace of its own.",
        annotations(
            title = "Snapshot a session",
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn snapshot_session(
        &self,
        Parameters(args): Parameters<SnapshotArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.snapshot_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "List your snapshots (id, name, the session and execution count they were taken at, size) as JSON, oldest first.",
        annotations(
            title = "List snapshots",
            read_only_hint = true,
            open_world_hint = false
        )
    )]
    async fn list_snapshots(
        &self,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.list_snapshots_call(Call::of(context)?).await
    }

    #[tool(
        description = "Delete a snapshot of yours (by id or name). Sessions started from it go on.",
        annotations(
            title = "Delete a snapshot",
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn delete_snapshot(
        &self,
        Parameters(args): Parameters<DeleteSnapshotArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.delete_snapshot_call(Call::of(context)?, args).await
    }

    #[tool(
        description = "Resume a paused session: its kernel comes back from disk with the state it was paused with. A session that is not paused is answered as it is. Answers the session as JSON.",
        annotations(
            title = "Resume a session",
            destructive_hint = false,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn resume_session(
        &self,
        Parameters(args): Parameters<SessionArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        self.resume_call(Call::of(context)?, args).await
    }
}

/// `run_code`'s description; `list_tools` adds the languages this broker has.
const RUN_CODE: &str = "Run code in a persistent Jupyter kernel of the given language and return what it printed, its result (tables, text), and any charts (PNG images). `language` defaults to python; without session_id each language has this connection's own session, all sharing one workspace (so a CSV uploaded once is read from Python, R and SQL alike). Variables persist across calls of the same session. On an error the result is an error with the language's message: fix the code and call again.";

#[tool_handler(router = self.tool_router)]
impl ServerHandler for McpServer {
    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, ErrorData> {
        let supports_cache_hints = context
            .protocol_version()
            .is_some_and(|version| version >= rmcp::model::ProtocolVersion::V_2026_07_28);
        let mut tools = self.tool_router.list_all();
        // The languages are this broker's (its kernels): named in run_code's description
        // and as its `language` argument's choices.
        let call = Call::of(context)?;
        let specs = &call.state.kernelspecs;
        for tool in tools.iter_mut().filter(|t| t.name == "run_code") {
            tool.description =
                Some(format!("{RUN_CODE} Languages here: {}.", specs.summary()).into());
            let mut schema = (*tool.input_schema).clone();
            if let Some(language) = schema
                .get_mut("properties")
                .and_then(|p| p.get_mut("language"))
                .and_then(|l| l.as_object_mut())
            {
                let mut names: Vec<serde_json::Value> = Vec::new();
                for spec in specs.iter() {
                    names.push(spec.name.clone().into());
                    names.extend(specs.aliases_of(&spec.name).into_iter().map(Into::into));
                }
                language.insert("enum".into(), serde_json::Value::Array(names));
                language.insert("type".into(), "string".into());
            }
            tool.input_schema = std::sync::Arc::new(schema);
        }
        Ok(rmcp::model::ListToolsResult {
            result_type: Some(rmcp::model::ResultType::COMPLETE),
            tools,
            meta: None,
            next_cursor: None,
            ttl_ms: supports_cache_hints.then_some(0),
            cache_scope: supports_cache_hints.then_some(rmcp::model::CacheScope::Public),
        })
    }

    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new(
            "kernel-broker",
            env!("CARGO_PKG_VERSION"),
        ))
        .with_instructions(INSTRUCTIONS)
    }

    /// Up to 2025-11-25, the last revision with MCP sessions: "without session_id, one
    /// broker session per MCP session" needs them (2026-07-28 is sessionless). Clients that
    /// also speak 2026-07-28 (Python `mcp` 2.x in its default mode) fall back to it.
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::V_2025_11_25))
    }

    /// rmcp's router answers an unknown tool with a bare "tool not found"; this names the
    /// tool and the ones there are, so a model can correct itself.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if self.tool_router.get(&request.name).is_none() {
            let names: Vec<String> = self
                .tool_router
                .list_all()
                .into_iter()
                .map(|t| t.name.to_string())
                .collect();
            return Err(ErrorData::invalid_params(
                format!(
                    "unknown tool {:?}; the tools are: {}",
                    request.name,
                    names.join(", ")
                ),
                None,
            ));
        }
        let call = ToolCallContext::new(self, request, context);
        self.tool_router.call(call).await
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        self.list_resources_call(Call::of(context)?).await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        self.read_resource_call(Call::of(context)?, &request.uri)
            .await
            .map(Into::into)
    }
}
